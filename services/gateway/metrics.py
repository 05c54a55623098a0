"""Gateway Prometheus metrics: the per-request ones (per-instance load and health live in
``instances``, routing and retries in ``routing``, ``fleet_memory.scoring`` and ``orchestrator``), and
which of all the process's series each reader sees (``page``).

Two readers. The public ``/metrics`` on ``--port``, open to anyone who reaches the API (as ``vllm
serve``'s): only ``PUBLIC``, series that move with how many requests came and how they were answered,
never with what a request carried, where it went or how long a stage took; a routing decision, an
instance's address or load, or an encode time would tell a caller what another one sent (a held item
routes "held", a cached image encodes faster). ``--epd-facts`` (which already puts the instances on
``/health`` and the timings in answers) shows it everything. The internal ``--metrics-host``:
``--metrics-port`` (``services.common.metrics_port``, loopback by default) always shows everything.

With ``--workers N`` both readers show the whole gateway, whichever worker answers: each worker's
supervisor (``services.gateway.workers``) sets ``PROMETHEUS_MULTIPROC_DIR`` in the worker's environment
before it starts, so prometheus_client keeps every value in a file there, and a page is built from all
the workers' files (``MultiProcessCollector``): counters and histograms summed over every worker that
ever ran (a dead one's counts stay), gauges as each declares (``multiprocess_mode``: ``livesum`` for the
gateway's counts in flight, ``livemin`` for an instance's health). The per-process ``process_*`` and
``python_*`` series are not merged: a page with workers has none.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from services.gateway.objectives import OBJECTIVES
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

WORKER_STARTS = Counter("epd_gateway_worker_starts_total", "Gateway worker processes started (--workers N: N at "
                        "start, one more for each worker replaced)")
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's: set in a worker's environment before it starts, it makes every value a file there."""

_STAGES = ("queue", "metadata", "encode", "transfer", "lm_queue", "ttft", "tpot", "total")


def observe(route: str, status: int, timings: Timings, media: int) -> None:
    """One finished request (``media``: its number of media items)."""
    REQUESTS.labels(route, str(status)).inc()
    if status != 200:
        return
    OBJECTIVES.observe(timings.ttft_ms, timings.tpot_ms)  # the attainment of the latency objectives
    for stage in _STAGES:
        value = getattr(timings, f"{stage}_ms")
        if value:  # a stage the request did not go through (a text request's encode) stays 0
            STAGE.labels(stage).observe(value / 1e3)
    for transport in timings.transports:
        ITEMS.labels(transport or "UNKNOWN").inc()
    if media > len(timings.transports):
        ITEMS.labels("LOCAL").inc(media - len(timings.transports))


PUBLIC = frozenset({
    "epd_gateway_requests_total",  # by route and status: what each caller sees of its own answer
    "epd_gateway_unauthenticated_total",
    "epd_gateway_bodies_refused_total",
    "epd_gateway_bodies_reading",
    "epd_gateway_slow_readers_total",
    "epd_gateway_admission_total",
    "epd_gateway_admission_waiting",
})
"""The series the public ``/metrics`` shows without ``--epd-facts`` (as exposed: counters with
``_total``). A series not named here (a new one too) is on the internal port only."""


def _exposed_name(family: Metric) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


@functools.cache
def registry() -> CollectorRegistry:
    """Every series of the gateway: the process's own registry, or, in a worker (``MULTIPROCESS_DIR_ENV``
    set), one that merges every worker's files at each scrape. Read, never registered into."""
    if not os.environ.get(MULTIPROCESS_DIR_ENV):
        return REGISTRY
    merged = CollectorRegistry()
    MultiProcessCollector(merged)
    return merged


class _PublicView:
    """The gateway's registry, ``PUBLIC`` families only (``generate_latest`` reads any ``collect()``)."""

    def collect(self) -> Iterator[Metric]:
        return (family for family in registry().collect() if _exposed_name(family) in PUBLIC)


def page(facts: bool) -> bytes:
    """The public ``/metrics``: ``PUBLIC`` only, or (``facts``: ``--epd-facts``) every series."""
    return generate_latest(registry() if facts else _PublicView())


def everything() -> bytes:
    """The internal port's ``/metrics``: every series."""
    return generate_latest(registry())
