"""The encoder, the LM and the gateway started at the same moment, none waiting
for another: the gateway listens at once and answers 503 with the reason while
the engines load, admits them as they become ready, and the first request it
takes is exact."""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from services.up import Deployment, grpc_serving, wait_ready
from tests.e2e.conftest import REFERENCE_REQUESTS, stop_in_background
from tests.e2e.helpers import post

pytestmark = pytest.mark.e2e

NOT_READY = "no LM is ready yet"


def _get(url: str) -> tuple[int, dict]:
    """Status and JSON body; (0, {}) while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def test_services_started_together_serve_the_first_request_exactly_once_the_lm_is_admitted(tiny_model, reference):
    dep = Deployment(model=tiny_model, quiet=True)
    deadline = time.monotonic() + 300
    lm_serving = functools.partial(grpc_serving, dep.lm_addr, security=dep.client_security)
    enc_serving = functools.partial(grpc_serving, dep.encoder_addr, security=dep.client_security)
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for svc in [dep.gateway, *dep.lms, *dep.encoders]:  # all at once; none waits for another
            svc.start(env)

        # The gateway listens long before an engine is loaded, and says what it waits for.
        wait_ready({dep.gateway: lambda: _get(dep.url + "/health")[0] in (200, 503)}, deadline, poll_s=0.2)
        status, health = _get(dep.url + "/health")
        chat_status, chat = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
        if not lm_serving():  # still loading (it takes tens of seconds): both answers were 503 for that reason
            assert status == 503 and health["status"].startswith(NOT_READY), health
            assert chat_status == 503 and chat["error"]["message"].startswith(NOT_READY), chat
            models_status, models = _get(dep.url + "/v1/models")
            assert models_status == 503 and models["error"]["message"].startswith(NOT_READY), models

        wait_ready({dep.lm: lm_serving, dep.encoder: enc_serving}, deadline)
        # Admitted at the gateway's next health round (plus gRPC's reconnect backoff, at most 2 s).
        wait_ready({dep.gateway: lambda: _admitted(dep)}, time.monotonic() + 30, poll_s=0.2)

        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference["image0"]
        assert body["epd"]["encoders"] == [dep.encoder_addr]  # through the encoder, not the LM's own
        status, models = _get(dep.url + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [tiny_model]
    finally:
        stop_in_background(dep)


def _admitted(dep: Deployment) -> bool:
    """/health is 200 and lists the LM and the encoder as admitted."""
    status, health = _get(dep.url + "/health")
    return (status == 200 and health.get("lms", {}).get(dep.lm_addr) is True
            and health.get("encoders", {}).get(dep.encoder_addr) is True)
