"""A mixed deployment: one LM that prefills and decodes beside a prefill/decode pair
(``epd up --lms 1 --prefills 1 --decodes 1``). The gateway sends a request to the pair while its decode LM
is no busier than the other LM, and to the other LM while the decode LM is busier; the tokens are plain
vLLM's either way. A client that goes away in the middle of a decode leaves nothing held on P or D.

Slow for the reason tests/e2e/test_pd.py gives (NIXL's progress threads busy-poll on a 2-core host);
its own module so that its deployment starts after the other P/D deployments have gone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.up import Deployment
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, image_chat, metric, producer_stats, settled, text_chat
from tests.e2e.test_pd import _chat, _chat_events
from tools.reference import run_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = {
    "image": image_chat(3900),
    "text": text_chat("Tell me a story about a horse."),
}


@pytest.fixture(scope="module")
def mixed(tiny_model):
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_subprocess, tiny_model, list(REQUESTS.values()))
        dep = Deployment(model=tiny_model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, n_lms=1, n_prefills=1, n_decodes=1)
        try:
            dep.start()
            yield dep, dict(zip(REQUESTS, reference.result()))
        finally:
            stop_in_background(dep)


def _kv_usage(lm) -> float:
    return metric(lm.metrics_port, "vllm:kv_cache_usage_perc")


def test_the_pair_serves_while_its_decode_lm_is_no_busier_and_the_other_lm_while_it_is(mixed):
    dep, ref = mixed
    by = {s.name: s for s in dep.lms}
    both, p, d = by["lm"], by["prefill"], by["decode"]

    out = _chat(dep, REQUESTS["image"])  # all idle: the pair
    assert out["choices"][0]["token_ids"] == ref["image"]
    assert (out["epd"]["prefill_lm"], out["epd"]["lm"]) == (p.address, d.address), out["epd"]

    # A long stream keeps the decode LM busy: the next request goes to the LM that does both.
    long = {**image_chat(3901, text="Tell me a long story.", max_tokens=400), "stream": True, "ignore_eos": True}
    events = _chat_events(dep, long)
    try:
        assert "choices" in next(events)  # dispatched, and decoding on the decode LM
        out = _chat(dep, REQUESTS["text"])
        assert out["choices"][0]["token_ids"] == ref["text"]
        assert out["epd"]["lm"] == both.address and "prefill_lm" not in out["epd"], out["epd"]
    finally:
        events.close()  # the client goes away mid-decode

    # The gateway cancels the decode; P had let its blocks go when D read them, D lets its own go.
    for lm in (p, d, both):
        assert settled(lambda lm=lm: _kv_usage(lm), 0.0, timeout=30) == 0.0, lm.name
    assert settled(lambda: producer_stats(dep)["items_held"], 0) == 0

    out = _chat(dep, REQUESTS["image"])  # idle again: the pair
    assert out["choices"][0]["token_ids"] == ref["image"]
    assert (out["epd"]["prefill_lm"], out["epd"]["lm"]) == (p.address, d.address), out["epd"]
