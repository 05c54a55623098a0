"""Issue 2 must-show: exact tokens through the gateway, counters, streaming,
text-only routing, concurrency."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import encodes_done, metric, settled

pytestmark = pytest.mark.e2e


def _create(client, name: str, **kw):
    body = dict(REFERENCE_REQUESTS[name])
    extra = {"return_token_ids": body.pop("return_token_ids")}  # vLLM's field, not the client's
    return client.chat.completions.create(model="", extra_body=extra, **body, **kw)


def test_image_chat_matches_plain_vllm_and_encodes_once_remotely(client, deployment, reference):
    encodes_done(deployment)  # an earlier request's encoder counts have landed: the baselines are final
    enc_runs = metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total")
    lm_runs = metric(deployment.lm_metrics, "epd_lm_local_encoder_runs_total")
    transferred = metric(deployment.lm_metrics, "epd_lm_transferred_items_total")
    layouts = {by: metric(deployment.lm_metrics, "epd_lm_prompt_layouts_total", by=by)
               for by in ("encoder", "processor")}

    resp = _create(client, "fresh")

    assert resp.choices[0].model_extra["token_ids"] == reference["fresh"]
    assert settled(lambda: metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total"),
                   enc_runs + 1) == enc_runs + 1
    # The LM laid the prompt out from the encoder's metadata: no image processing there.
    assert metric(deployment.lm_metrics, "epd_lm_prompt_layouts_total", by="encoder") == layouts["encoder"] + 1
    assert metric(deployment.lm_metrics, "epd_lm_prompt_layouts_total", by="processor") == layouts["processor"]
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
    encodes_done(deployment)  # the previous test's Encode is counted before the baseline, not after it
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


def _curl(*args: str) -> tuple[dict[str, str], str]:
    """Runs curl -i; returns the response headers (lower-case names) and the body."""
    out = subprocess.run(["curl", "-sS", "-i", "--max-time", "60", *args], capture_output=True, text=True,
                         check=True).stdout
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    headers = dict(line.split(": ", 1) for line in head.splitlines()[1:] if ": " in line)
    return {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_chat_streaming_and_one_request_id_through_every_service(deployment, reference):
    rid = f"curl-{uuid.uuid4().hex[:12]}"
    body = json.dumps(REFERENCE_REQUESTS["image1"])
    headers, text = _curl("-H", "Content-Type: application/json", "-H", f"X-Request-Id: {rid}", "-d", body,
                          deployment.url + "/v1/chat/completions")
    assert headers["x-request-id"] == rid
    full = json.loads(text)
    assert full["id"] == f"chatcmpl-{rid}" and full["choices"][0]["token_ids"] == reference["image1"]

    stream_body = json.dumps(dict(REFERENCE_REQUESTS["image1"], stream=True))
    headers, text = _curl("-N", "-H", "Content-Type: application/json", "-d", stream_body,
                          deployment.url + "/v1/chat/completions")
    assert headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{headers['x-request-id']}"}
    tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert tokens == reference["image1"]

    # The client's id names the request in the gateway's and the encoder's logs (the
    # encoder logs when its engine is done, which may be just after the answer).
    for name in ("gateway.log", "encoder.log"):
        path = os.path.join(deployment.log_dir, name)

        def logged(path: str = path) -> bool:
            with open(path, errors="replace") as f:
                return rid in f.read()
        assert settled(logged, True), name


def test_every_service_logs_its_own_lines(deployment):
    """Each service's INFO lines reach its log (vLLM's app, built in the LM, must not silence them)."""
    import os

    for name, line in (("lm", "lm ready"), ("encoder", "encoder ready"), ("gateway", "gateway listening")):
        with open(os.path.join(deployment.log_dir, f"{name}.log"), errors="replace") as f:
            assert line in f.read(), name
