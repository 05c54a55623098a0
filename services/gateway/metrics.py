"""Gateway Prometheus metrics, served on the gateway's /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.gateway.orchestrator import Timings

REQUESTS = Counter("epd_gateway_requests_total", "Requests by API route and HTTP-style status", ["route", "status"])
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STAGE = Histogram("epd_gateway_stage_seconds",
                  "Per-stage latency seen by the gateway (metadata, encode, transfer, ttft, total)",
                  ["stage"], buckets=_BUCKETS)


def observe(route: str, status: int, timings: Timings, media: bool) -> None:
    REQUESTS.labels(route, str(status)).inc()
    if status != 200:
        return
    stages = ("metadata", "encode", "transfer", "ttft", "total") if media else ("ttft", "total")
    for stage in stages:
        value = getattr(timings, f"{stage}_ms")
        if value:
            STAGE.labels(stage).observe(value / 1e3)
