"""Each service of the session's deployment exports its scaling signals on its internal metrics port, with
real engines: vLLM's own LM series (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, from the Prometheus logger vLLM's AsyncLLM runs in the LM's process), the
LM's requests waiting for encoder outputs, the encoder's queue depth, busy seconds and items, every
engine's draining flag, and the gateway's objective attainment; and an image request moves the ones it
should (the encoder's items and busy seconds, the gateway's window), leaving the gauges back at rest.
How each moves step by step: tests/unit/test_signals.py and tests/integration/test_signals.py."""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.e2e.helpers import encodes_done, image_chat, metric, post, settled

pytestmark = pytest.mark.e2e

LM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "epd_lm_waiting_for_items", "epd_instance_draining")
ENCODER_SERIES = ("epd_encoder_queue_depth", "epd_encoder_busy_seconds_total", "epd_encoder_items_total",
                  "epd_instance_draining")
GATEWAY_SERIES = ("epd_gateway_objective_attainment", "epd_gateway_objective_window_requests",
                  "epd_gateway_stage_seconds_bucket")


def series(port: int) -> set[str]:
    """The names of every sample on a metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}


def test_every_service_exports_its_scaling_signals_and_an_image_request_moves_them(deployment):
    encodes_done(deployment)
    enc, lm, gw = deployment.encoder_metrics, deployment.lm_metrics, deployment.gateway_metrics
    items0, busy0 = metric(enc, "epd_encoder_items_total"), metric(enc, "epd_encoder_busy_seconds_total")

    status, body = post(deployment.url + "/v1/chat/completions", image_chat(seed=4242, max_tokens=4))
    assert status == 200, body
    encodes_done(deployment)

    for port, wanted in ((lm, LM_SERIES), (enc, ENCODER_SERIES), (gw, GATEWAY_SERIES)):
        missing = set(wanted) - series(port)
        assert not missing, (port, missing)
    assert settled(lambda: metric(enc, "epd_encoder_items_total"), items0 + 1) == items0 + 1
    assert metric(enc, "epd_encoder_busy_seconds_total") > busy0  # the engine ran for it
    assert settled(lambda: metric(enc, "epd_encoder_queue_depth"), 0.0) == 0.0
    assert settled(lambda: metric(lm, "epd_lm_waiting_for_items"), 0.0) == 0.0
    assert metric(lm, "epd_instance_draining") == metric(enc, "epd_instance_draining") == 0.0
    assert 0.0 <= metric(lm, "vllm:kv_cache_usage_perc") <= 1.0
    assert metric(gw, "epd_gateway_objective_window_requests") >= 1  # this one, finished within the window
    for objective in ("ttft", "tpot", "both"):
        assert 0.0 <= metric(gw, "epd_gateway_objective_attainment", objective=objective) <= 1.0
