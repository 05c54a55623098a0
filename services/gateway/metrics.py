"""Gateway Prometheus metrics, served on the gateway's /metrics. Per-instance
load and health live in ``instances``, routing and retries in ``routing`` and
``orchestrator``; this module has the per-request ones."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.gateway.values import Timings

REQUESTS = Counter("epd_gateway_requests_total", "Requests by API route and HTTP-style status", ["route", "status"])
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STAGE = Histogram("epd_gateway_stage_seconds",
                  "Per-stage latency of successful requests: queue (arrival to first dispatch: parsing, media "
                  "fetch, routing), metadata, encode, transfer (LM wait for embeddings), lm_queue (LM scheduler "
                  "queue), ttft, tpot (per output token after the first), total",
                  ["stage"], buckets=_BUCKETS)
ITEMS = Counter("epd_gateway_items_total", "Media items by how they reached the LM "
                "(a transport name, or LOCAL when the LM encoded them)", ["transport"])

_STAGES = ("queue", "metadata", "encode", "transfer", "lm_queue", "ttft", "tpot", "total")


def observe(route: str, status: int, timings: Timings, media: int) -> None:
    """One finished request (``media``: its number of media items)."""
    REQUESTS.labels(route, str(status)).inc()
    if status != 200:
        return
    for stage in _STAGES:
        value = getattr(timings, f"{stage}_ms")
        if value:  # a stage the request did not go through (a text request's encode) stays 0
            STAGE.labels(stage).observe(value / 1e3)
    for transport in timings.transports:
        ITEMS.labels(transport or "UNKNOWN").inc()
    if media > len(timings.transports):
        ITEMS.labels("LOCAL").inc(media - len(timings.transports))
