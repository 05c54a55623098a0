"""Issue 15: each placement choice gives plain vLLM's tokens, and says what it chose.

Two more gateways on the session deployment's encoder and LM: one with
``--placement local`` (the LM encodes the image itself, as colocated vLLM does)
and one with ``--placement auto``; the session's gateway runs the default,
``encoder``. A third with no encoder at all serves colocated (the serving
benchmark's baseline system): the LM's vLLM encodes the image itself. Also admission past capacity: a gateway that admits one request at a
time and lets one wait answers every request or refuses it at once with 429
(``Retry-After``), never half-way through."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.probe import http_ok
from services.up import Service, free_port, wait_ready
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import image_chat, post, wait_admitted

pytestmark = pytest.mark.e2e


def _gateway(deployment, name: str, *args: str, encoders: bool = True):
    port = free_port()
    svc = Service(f"gateway-{name}", ["gateway", "--epd-facts", "--host", "127.0.0.1", "--port", str(port),
                                      "--encoders", deployment.encoder_addr if encoders else "",
                                      "--lms", deployment.lm_addr, *args, *deployment.security_args],
                  os.path.join(deployment.log_dir, f"gateway-{name}.log"))
    svc.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready({svc: lambda: http_ok(url + "/health")}, time.monotonic() + 120, poll_s=0.3)
        # Ready is the LM admitted; the encoder may come a health round later (an image sent before
        # would be encoded on the LM: "auto" would not choose the encoder).
        wait_admitted(port, [deployment.encoder_addr] if encoders else [], [deployment.lm_addr])
    except BaseException:
        svc.stop()
        raise
    return svc, url


@pytest.fixture(scope="module")
def gateways(deployment):
    started = []
    try:
        for choice in ("local", "auto"):
            started.append((choice, *_gateway(deployment, choice, "--placement", choice)))
        started.append(("colocated", *_gateway(deployment, "colocated", encoders=False)))
        yield {choice: url for choice, _, url in started} | {"encoder": deployment.url}
    finally:
        for _, svc, _ in started:
            svc.stop()


@pytest.mark.parametrize("choice", ["local", "encoder", "auto"])
def test_each_placement_returns_plain_vllms_tokens(gateways, reference, choice):
    status, body = post(gateways[choice] + "/v1/chat/completions", REFERENCE_REQUESTS["image2"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["image2"]
    epd = body["epd"]
    if choice == "local":
        assert epd["placement"] == "local" and epd["encoders"] == [] and epd["transferred_items"] == 0
        assert epd["local_encoder_runs"] >= 0  # 0 when vLLM's encoder cache already had the image
    else:  # an idle LM and an idle encoder: auto encodes remotely too
        assert epd["placement"] == "encoder" and epd["encoders"] and epd["local_encoder_runs"] == 0


def test_text_requests_have_no_placement(gateways, reference):
    status, body = post(gateways["local"] + "/v1/chat/completions", REFERENCE_REQUESTS["text"])
    assert status == 200 and body["choices"][0]["token_ids"] == reference["text"]
    assert body["epd"]["placement"] == ""


def test_past_capacity_every_request_is_answered_or_refused_at_admission(deployment):
    """One request in flight, one waiting: a burst of eight gets 200s and 429s only, each 429
    at once with Retry-After; none fails after it was admitted."""
    svc, url = _gateway(deployment, "admission", "--lm-max-outstanding", "1", "--admission-queue", "1")
    try:
        bodies = [image_chat(4100 + i, max_tokens=24) for i in range(8)]

        def send(body):
            t0 = time.monotonic()
            status, out = post(url + "/v1/chat/completions", body, timeout=120)
            return status, out, time.monotonic() - t0

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(send, bodies))
        statuses = sorted(s for s, _, _ in results)
        assert set(statuses) <= {200, 429}, results
        assert statuses.count(200) >= 2 and 429 in statuses, statuses
        for status, out, elapsed in results:
            if status == 429:
                assert out["error"]["type"] == "rate_limit_error" and "capacity" in out["error"]["message"]
                assert elapsed < 20  # refused at once, not after a wait (--admission-wait-s, 60 s)
            else:
                assert len(out["choices"][0]["token_ids"]) == 24
    finally:
        svc.stop()


def test_a_gateway_without_encoders_serves_colocated_with_exact_tokens(gateways, reference):
    """The LM's vLLM encodes an image it has never seen, as plain vLLM does."""
    status, body = post(gateways["colocated"] + "/v1/chat/completions", REFERENCE_REQUESTS["colocated"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["colocated"]
    assert body["epd"]["local_encoder_runs"] == 1 and body["epd"]["transferred_items"] == 0
    assert body["epd"]["encoders"] == []
