"""E -> P -> D for Qwen2.5-VL, whose positions are M-RoPE: the decode LM's positions for the tokens it
generates follow from each item's grid (the metadata the encoder sent, forwarded to both LMs), not from
the token count, so a decode LM that laid the prompt out differently from the prefill LM would drift
from plain vLLM after the first token. ``epd up --prefills 1 --decodes 1`` against ``LLM.chat``.

Slow for the reason tests/e2e/test_pd.py gives (NIXL's progress threads busy-poll on a 2-core host);
its own module so that its deployment starts after test_pd's has gone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.cli import default_model
from services.up import Deployment
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, image_chat, metric, producer_stats, settled, text_chat
from tests.e2e.test_families import _video_chat
from tests.e2e.test_pd import (
    _chat,
    _image_part,
    _lms,
    _stream_tokens,
    assert_choices_equal,
    assert_logprobs_equal,
    assert_prefilled_then_decoded,
)
from tools.reference import run_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = {
    "text": text_chat("Tell me a story about a cat."),
    "image": image_chat(3800),
    "two images": {"messages": [{"role": "user", "content": [
        _image_part(3801), {"type": "text", "text": "and"}, _image_part(3802, (150, 120)),
        {"type": "text", "text": "compare"}]}], "max_tokens": 10, "temperature": 0, "return_token_ids": True},
    "video": _video_chat([("video", 3803)], "What happens in this video?"),
}
MORE = {
    "stream": {**image_chat(3804), "stream": True, "stream_options": {"include_usage": True}},
    "logprobs": {**image_chat(3805), "logprobs": True, "top_logprobs": 2},
    "seeded n=2": {**image_chat(3806), "temperature": 0.8, "seed": 11, "n": 2},
}


@pytest.fixture(scope="module")
def qwen_pd():
    model = default_model(family="qwen2_5_vl")
    with ThreadPoolExecutor(1) as pool:
        bodies = [{k: v for k, v in b.items() if k not in ("stream", "stream_options")}
                  for b in {**REQUESTS, **MORE}.values()]
        reference = pool.submit(run_subprocess, model, bodies)
        dep = Deployment(model=model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, n_lms=0, n_prefills=1, n_decodes=1)
        try:
            dep.start()
            yield dep, dict(zip({**REQUESTS, **MORE}, reference.result()))
        finally:
            stop_in_background(dep)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_qwen2_5_vl_greedy_tokens_equal_plain_vllm(qwen_pd, name):
    dep, ref = qwen_pd
    assert_prefilled_then_decoded(dep, _chat(dep, REQUESTS[name]), ref[name])
    assert settled(lambda: producer_stats(dep)["items_held"], 0) == 0


def test_qwen2_5_vl_stream_logprobs_and_seeded_n2_equal_plain_vllm(qwen_pd):
    dep, ref = qwen_pd
    assert _stream_tokens(dep, MORE["stream"]) == ref["stream"]
    assert_logprobs_equal(_chat(dep, MORE["logprobs"]), ref["logprobs"])
    assert_choices_equal(_chat(dep, MORE["seeded n=2"]), ref["seeded n=2"])


def test_qwen2_5_vl_decode_lm_computes_none_of_the_prompt(qwen_pd):
    dep, _ = qwen_pd
    p, d = _lms(dep)
    assert metric(d.metrics_port, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert metric(d.metrics_port, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    for lm in (p, d):
        assert metric(lm.metrics_port, "epd_lm_local_encoder_runs_total") == 0, lm.name
