"""The LM's scaling signals: what an autoscaler (the local ``epd`` autoscaler, a Kubernetes HPA through
prometheus-adapter) reads from this service's internal metrics port (``--metrics-port``).

- vLLM's own series, from its ``PrometheusStatLogger``, which ``AsyncLLM`` makes in this process whenever
  the engine keeps stats (vLLM's default; ``--disable-log-stats`` in ``--vllm-args`` would remove them):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1),
  labelled ``model_name`` and ``engine``; and its histograms ``vllm:time_to_first_token_seconds`` (from the
  request reaching the engine) and ``vllm:request_time_per_output_token_seconds`` (each finished request's
  mean), whose buckets' change between two scrapes gives the TTFT and TPOT p90 the local autoscaler reads
  against the objectives. They sit in the process's default registry, which
  ``services.common.metrics_port`` serves, so nothing here re-makes them.
- ``epd_lm_waiting_for_items`` (gauge): requests that carry encoder outputs, are in the engine and have no
  first token yet: waiting for their embeddings to land (or, in their last moments, for their prefill). A
  count that grows here while ``vllm:num_requests_running`` stays low says the encoders, not the LM, are
  short.
- ``epd_instance_draining`` (gauge 0/1, ``services.common.signals``): 1 once the instance drains.

``WAITING`` is the process's one ``WaitingForItems``: the servicer's Generate handlers ``track`` their
call's ``RequestContext`` and ``forget`` it when the call ends; a scrape counts, on the same event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.signals import DRAINING

if TYPE_CHECKING:
    from services.lm.context import RequestContext

__all__ = ["DRAINING", "WAITING", "WaitingForItems"]


def waits_for_items(ctx: RequestContext) -> bool:
    """Whether a call's request waits on encoder outputs: it names an encoder for an item, the engine has
    it (``ConsumerEngine`` marks ``submitted``) and no token came back yet (``first_token_at``)."""
    return bool(ctx.sources) and ctx.submitted and not ctx.first_token_at


class WaitingForItems:
    """The Generate calls in flight (their contexts, by identity), counted by ``waits_for_items``."""

    def __init__(self) -> None:
        self._calls: dict[int, RequestContext] = {}

    def track(self, ctx: RequestContext) -> None:
        self._calls[id(ctx)] = ctx

    def forget(self, ctx: RequestContext) -> None:
        self._calls.pop(id(ctx), None)

    def count(self) -> int:
        return sum(1 for ctx in self._calls.values() if waits_for_items(ctx))


class _WaitingCollector(Collector):
    def __init__(self, waiting: WaitingForItems) -> None:
        self._waiting = waiting

    def collect(self):
        yield GaugeMetricFamily("epd_lm_waiting_for_items", "Requests in the engine that carry encoder outputs "
                                "and have no first token yet (waiting for their embeddings)",
                                value=self._waiting.count())


WAITING = WaitingForItems()
REGISTRY.register(_WaitingCollector(WAITING))
