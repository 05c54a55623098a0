"""Stand-ins for the few vLLM objects the connector halves read (a config and a
Request), so the halves run for real without an engine: real gRPC, real
shared memory, real pools. One place for these builders."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from vllm.multimodal.inputs import PlaceholderRange

WIDTH = 128


def vllm_config(engine_id: str, width: int = WIDTH):
    mc = SimpleNamespace(model="test-model", dtype=torch.bfloat16, get_hidden_size=lambda: width)
    ec = SimpleNamespace(engine_id=engine_id, mm_encoder_output_widths={"image": width})
    return SimpleNamespace(model_config=mc, ec_transfer_config=ec)


def request(rid: str, items: list[tuple[str, int]], endpoint: str | None = None, width: int = WIDTH,
            claim: str | None = None):
    """A request whose prompt holds ``items`` as (identifier, num_embeds), each
    placeholder 3 tokens longer than its embeddings, starting at token 5. With
    ``endpoint`` (an LM request), each item names that encoder and the claim of
    the request's Encode call (``claim``, default ``claim_of(rid)``)."""
    feats, pos = [], 5
    for ident, n in items:
        # vLLM's own placeholder (its embedding rows between one opening and two closing tokens), so the
        # connector reads it by vLLM's rules.
        is_embed = torch.tensor([False] + [True] * n + [False, False])
        feats.append(SimpleNamespace(identifier=ident, modality="image",
                                     mm_position=PlaceholderRange(offset=pos, length=n + 3, is_embed=is_embed)))
        pos += n + 3
    params = None
    if endpoint is not None:
        claim = claim_of(rid) if claim is None else claim
        params = {"items": {i: {"endpoint": endpoint, "embed_width": width, "dtype": "bfloat16", "claim": claim}
                            for i, _ in items}}
    req = SimpleNamespace(request_id=rid, mm_features=feats, ec_transfer_params=params)
    req.get_num_encoder_embeds = lambda i: feats[i].mm_position.get_num_embeds()
    return req


def claim_of(rid: str) -> str:
    """The claim of the Encode call that request ``rid``'s items came from (what the encoder sends)."""
    return f"claim-{rid}"


def steps_until(predicate, timeout: float = 30.0) -> bool:
    """Calls ``predicate`` like successive engine steps until it holds. The default deadline only
    bounds a hang (it returns as soon as the predicate holds): generous, for a slow, busy host."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def embedding(n: int, seed: int, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def schedule(sched, req):
    """vLLM's scheduler once ``ensure_cache_available`` says yes: allocate the
    items that landed, then build the worker's metadata for the step."""
    for i, feat in enumerate(req.mm_features):
        if sched.has_cache_item(feat.identifier):
            sched.update_state_after_alloc(req, i)
    return sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0))
