"""Issue 2 must-show: exact tokens through the gateway, counters, streaming,
text-only routing, concurrency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import metric

pytestmark = pytest.mark.e2e


def _create(client, name: str, **kw):
    return client.chat.completions.create(model="", **REFERENCE_REQUESTS[name], **kw)


def test_image_chat_matches_plain_vllm_and_encodes_once_remotely(client, deployment, reference):
    enc_runs = metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total")
    lm_runs = metric(deployment.lm_metrics, "epd_lm_local_encoder_runs_total")
    transferred = metric(deployment.lm_metrics, "epd_lm_transferred_items_total")

    resp = _create(client, "fresh")

    assert resp.choices[0].model_extra["token_ids"] == reference["fresh"]
    assert metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total") == enc_runs + 1
    assert metric(deployment.lm_metrics, "epd_lm_local_encoder_runs_total") == lm_runs  # never on the LM
    assert metric(deployment.lm_metrics, "epd_lm_transferred_items_total") == transferred + 1
    assert resp.usage.completion_tokens == len(reference["fresh"])


def test_multi_tile_image_matches_plain_vllm(client, reference):
    resp = _create(client, "image2")
    assert resp.choices[0].model_extra["token_ids"] == reference["image2"]


def test_streaming_and_non_streaming_return_the_same_text(client, reference):
    full = _create(client, "image1")
    chunks = list(_create(client, "image1", stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == full.choices[0].message.content
    assert tokens == reference["image1"] == full.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == len(reference["image1"])


def test_text_only_request_never_reaches_the_encoder(client, deployment, reference):
    before = metric(deployment.encoder_metrics, "epd_encoder_requests_total")
    resp = _create(client, "text")
    assert resp.choices[0].model_extra["token_ids"] == reference["text"]
    assert metric(deployment.encoder_metrics, "epd_encoder_requests_total") == before


def test_concurrent_requests_with_different_images_get_their_own_tokens(client, reference):
    names = ["image0", "image1", "image0", "image1"]
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: _create(client, n), names))
    for name, resp in zip(names, results):
        assert resp.choices[0].model_extra["token_ids"] == reference[name], name


def test_models_and_completions(client, deployment, reference):
    models = client.models.list().data
    assert [m.id for m in models] == [deployment.model]
    resp = client.completions.create(model=deployment.model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert resp.choices[0].text and resp.usage.completion_tokens == 8
