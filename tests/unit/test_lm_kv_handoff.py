"""The LM's half of E -> P -> D without an engine: a caller's kv_transfer_params never reach vLLM, the
gateway's KVHandoff sets them, a phase the LM's role does not take is refused, and the consumer connector
needs an item exactly where vLLM's scheduler would run it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from vllm.multimodal.inputs import PlaceholderRange
from vllm.sampling_params import SamplingParams

from ectransfer.connector.consumer import _embeds_from
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput, EncoderUnavailable, PrefillKVUnavailable, RoleMismatch, _status
from services.lm.context import CURRENT, RequestContext
from services.lm.frontend import ConsumerEngine, _recorded
from services.lm.handoff import DECODE, REMOTE_DECODE, Handoff
from services.lm.servicer import _kv_outcome, openai_body, vllm_body

pytestmark = pytest.mark.unit

BOGUS = {"do_remote_prefill": True, "remote_host": "10.255.255.1", "remote_port": 9}


def _request(body: dict | bytes, api: str = "chat") -> lm_pb2.GenerateRequest:
    req = lm_pb2.GenerateRequest(request_id="r")
    req.openai.api = api
    req.openai.body = body if isinstance(body, bytes) else json.dumps(body).encode()
    return req


def _vllm_raw(raw: bytes, prefill_responses: bool = False) -> bytes:
    return vllm_body(_request(raw, "http"), prefill_responses)[1]


def test_a_bodys_kv_transfer_params_are_dropped_whatever_the_spelling():
    assert "kv_transfer_params" not in openai_body(_request({"messages": [], "kv_transfer_params": BOGUS}))
    escaped = b'{"model": "m", "kv\\u005ftransfer_params": {"do_remote_prefill": true}}'  # one key to json
    assert json.loads(_vllm_raw(escaped)) == {"model": "m"}
    plain = b'{"model":"m","input":"hi"}'
    assert _vllm_raw(plain) == plain  # left as the client wrote it when there is nothing to drop
    with pytest.raises(BadInput, match="not JSON"):
        _vllm_raw(b"not json")
    assert _vllm_raw(b"") == b""  # a GET


def _engine_call(ctx: RequestContext | None, params: SamplingParams, kwargs: dict | None = None):
    """The sampling params vLLM's engine gets (``kwargs``: the keyword arguments it gets, filled in)."""
    calls = []
    engine = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=False),
                             generate=lambda *a, **k: calls.append((a, k)) or _empty())
    consumer = object.__new__(ConsumerEngine)  # its renderer is not needed here
    consumer._engine = engine
    token = CURRENT.set(ctx)
    try:
        consumer.generate("prompt", params, "rid", session_id="a client's session")
    finally:
        CURRENT.reset(token)
    ((args, kw),) = calls
    if kwargs is not None:
        kwargs.update(kw)
    return args[1]


def test_the_engines_session_id_is_the_gateways_prefix_key_never_a_clients():
    """vLLM publishes a request's session id on each KV block it stores: the LM's holdings by prefix key."""
    ctx, sent = RequestContext(media=None), {}
    ctx.prefix_key = "p:abc"
    _engine_call(ctx, SamplingParams(), sent)
    assert sent["session_id"] == "p:abc"
    _engine_call(RequestContext(media=None), SamplingParams(), sent)
    assert sent["session_id"] is None


async def _empty():
    return
    yield


def test_vllm_xargs_cannot_name_a_prefill_engine_and_the_handoff_sets_the_sampling():
    # A plain request: a caller's kv_transfer_params (vllm_xargs ends up in extra_args) are gone.
    sent = _engine_call(RequestContext(media=None), SamplingParams(extra_args={"kv_transfer_params": BOGUS, "x": 1}))
    assert sent.extra_args == {"x": 1}
    # PREFILL: one sequence, one token, and the blocks kept for a decode engine.
    ctx = RequestContext(media=None, kv=Handoff(lm_pb2.KVHandoff.PREFILL))
    sent = _engine_call(ctx, SamplingParams(n=2, max_tokens=50, min_tokens=5, seed=3,
                                            extra_args={"kv_transfer_params": BOGUS}))
    assert (sent.n, sent.max_tokens, sent.min_tokens) == (1, 1, 0)
    assert sent.extra_args["kv_transfer_params"] == REMOTE_DECODE
    # DECODE: the gateway's params, not the caller's.
    handed = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}
    ctx = RequestContext(media=None, kv=Handoff(lm_pb2.KVHandoff.DECODE, handed))
    sent = _engine_call(ctx, SamplingParams(n=2, max_tokens=8, extra_args={"kv_transfer_params": BOGUS}))
    assert sent.extra_args["kv_transfer_params"] == handed and (sent.n, sent.max_tokens) == (2, 8)


@pytest.mark.parametrize("role,phase,params,kind,error", [
    # A phase the role does not take: the gateway's view of the LM is stale (FAILED_PRECONDITION with
    # ``epd-fault: role``: it verifies the LM again and retries elsewhere).
    ("both", lm_pb2.KVHandoff.PREFILL, b"", RoleMismatch, "takes no PREFILL"),
    ("decode", lm_pb2.KVHandoff.PREFILL, b"", RoleMismatch, "takes no PREFILL"),
    ("prefill", lm_pb2.KVHandoff.DECODE, b"{}", RoleMismatch, "takes no DECODE"),
    ("prefill", lm_pb2.KVHandoff.RELEASE, b"{}", RoleMismatch, "takes no RELEASE"),
    ("both", lm_pb2.KVHandoff.RELEASE, b"{}", RoleMismatch, "takes no RELEASE"),
    # A malformed hand-off: the caller's fault (INVALID_ARGUMENT).
    ("decode", lm_pb2.KVHandoff.DECODE, b"[1]", BadInput, "kv_transfer_params"),
    ("decode", lm_pb2.KVHandoff.DECODE, b"{not json", BadInput, "not JSON"),
    ("decode", 7, b"", BadInput, "PREFILL, DECODE or RELEASE"),
])
def test_a_handoff_the_role_does_not_take_is_refused(role, phase, params, kind, error):
    with pytest.raises(kind, match=error) as got:
        _handoff(role, phase, params)
    assert _status(got.value, "Generate")[2] == ((("epd-fault", "role"),) if kind is RoleMismatch else ())


def _handoff(role: str, phase, params: bytes = b"") -> Handoff:
    """The call's hand-off as the servicer reads it (once) and checks it against the LM's role."""
    kv = Handoff.of(lm_pb2.GenerateRequest(kv=lm_pb2.KVHandoff(phase=phase, params=params)))
    kv.check(role)
    return kv


def test_the_handoffs_a_role_takes():
    got = _handoff("prefill", lm_pb2.KVHandoff.PREFILL)
    assert (got.phase, got.params) == (lm_pb2.KVHandoff.PREFILL, None)
    got = _handoff("decode", lm_pb2.KVHandoff.DECODE, b'{"do_remote_prefill": true}')
    assert (got.phase, got.params) == (lm_pb2.KVHandoff.DECODE, {"do_remote_prefill": True})
    assert Handoff.of(lm_pb2.GenerateRequest()) == Handoff()  # no hand-off: this LM prefills and decodes
    with pytest.raises(BadInput, match="PREFILL, DECODE or RELEASE"):  # a KVHandoff without a phase
        Handoff.of(lm_pb2.GenerateRequest(kv=lm_pb2.KVHandoff())).check("decode")
    # A refused DECODE call still has the prefill LM's params read, for the release.
    assert Handoff.of(lm_pb2.GenerateRequest(kv=lm_pb2.KVHandoff(
        phase=lm_pb2.KVHandoff.DECODE, params=b'{"do_remote_prefill": true}'))).params == {"do_remote_prefill": True}


def test_an_item_is_needed_while_an_embedding_row_is_left_to_compute():
    # Tokens 10..15: an opening token, four embedding rows, a closing token (Idefics3's shape).
    pos = PlaceholderRange(offset=10, length=6, is_embed=torch.tensor([False, True, True, True, True, False]))
    assert _embeds_from(pos, 0) and _embeds_from(pos, 10) and _embeds_from(pos, 14)
    assert not _embeds_from(pos, 15)  # only the closing token left: vLLM runs no encoder for it
    assert not _embeds_from(pos, 16) and not _embeds_from(pos, 40)
    plain = PlaceholderRange(offset=10, length=6)  # every row an embedding
    assert _embeds_from(plain, 15) and not _embeds_from(plain, 16)


def _failed_output():
    return SimpleNamespace(outputs=[SimpleNamespace(finish_reason="error", token_ids=[], index=0)],
                           ec_transfer_params=None, kv_transfer_params=None)


async def _drain(ctx: RequestContext):
    async def engine():
        yield _failed_output()

    async for _ in _recorded(engine(), ctx, "r", delta=True):
        pass


def test_a_decode_request_the_engine_failed_blames_the_prefill_lm_and_any_other_the_encoder():
    """vLLM fails a request whose KV it could not load (kv_load_failure_policy "fail") as it fails one
    whose embedding could not be read: on a decode LM the KV is blamed (``epd-fault: prefill``)."""
    ctx = RequestContext(kv=Handoff(DECODE, {"remote_engine_id": "engine-p"}))
    with pytest.raises(PrefillKVUnavailable, match="engine engine-p") as e:
        asyncio.run(_drain(ctx))
    assert e.value.fault == lm_pb2.FAULT_PREFILL and ctx.failure is e.value
    whole = RequestContext()
    whole.sources = {"item": SimpleNamespace(endpoint="enc:1")}
    with pytest.raises(EncoderUnavailable):
        asyncio.run(_drain(whole))


@pytest.mark.parametrize("status, submitted, failure, outcome", [
    ("ok", True, None, "ok"),
    ("ok", False, None, "refused"),  # answered before the engine: vLLM's validation
    ("error", True, PrefillKVUnavailable("x"), "kv_unavailable"),
    ("error", True, EncoderUnavailable("x"), "error"),
    ("cancelled", True, None, "cancelled"),
])
def test_each_handoff_call_is_counted_by_its_outcome(status, submitted, failure, outcome):
    ctx = RequestContext(kv=Handoff(DECODE))
    ctx.submitted, ctx.failure = submitted, failure
    assert _kv_outcome(status, ctx) == outcome


def test_responses_prefill_call_stores_nothing_and_runs_in_the_call():
    body = b'{"input": "hi", "store": true, "background": true, "kv_transfer_params": {"x": 1}}'
    assert json.loads(_vllm_raw(body, prefill_responses=True)) == {
        "input": "hi", "store": False, "background": False}
    assert json.loads(_vllm_raw(b'{"input": "hi"}', prefill_responses=True)) == {
        "input": "hi", "store": False, "background": False}


def test_a_handoff_takes_one_engine_call_and_a_second_is_refused():
    """Beam search calls the engine once per beam per step: on a prefill LM every call would keep blocks,
    on a decode LM each would load the one call's KV. The gateway splits no such request; the LM refuses
    the second call of a hand-off all the same."""
    ctx = RequestContext(media=None, kv=Handoff(lm_pb2.KVHandoff.PREFILL))
    _engine_call(ctx, SamplingParams(max_tokens=4))
    with pytest.raises(BadInput, match="more than one engine call"):
        _engine_call(ctx, SamplingParams(max_tokens=4))
    assert isinstance(ctx.failure, BadInput)
    plain = RequestContext(media=None)  # no hand-off: as many calls as vLLM makes
    for _ in range(3):
        _engine_call(plain, SamplingParams(max_tokens=4))
