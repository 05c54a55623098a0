"""The encoder's scaling signals: what an autoscaler (the local ``epd`` autoscaler, a Kubernetes HPA through
prometheus-adapter) reads from this service's internal metrics port (``--metrics-port``).

- ``epd_encoder_queue_depth`` (gauge): items admitted by Encode and not yet encoded (waiting for the
  decoder, the processor or the engine, plus running in the engine). An upload counts as one item. A depth
  that stays above a few items per instance asks for more encoders.
- ``epd_encoder_busy_seconds_total`` (counter): seconds the engine had at least one Encode request;
  ``rate()`` of it is the busy share 0..1, the encoder's utilisation. It moves while a request runs (read
  at each scrape), not only when one ends.
- ``epd_encoder_items_total`` (counter, beside the handlers): ``rate()`` is items per second.
- ``epd_encoder_service_wait_seconds_total`` and ``epd_encoder_engine_requests_total`` (counters): the
  seconds Encode calls waited in this service from admission until their engine request was submitted
  (fetching nothing, but decoding, the processor, the limits), summed, and how many calls got that far.
  The change of one over the other between two scrapes is the mean wait in front of the engine.
- ``epd_instance_draining`` (gauge 0/1, ``services.common.signals``): 1 once the instance drains.
- vLLM's own ``vllm:request_queue_time_seconds`` (histogram), from the ``PrometheusStatLogger`` the encoder
  engine's ``AsyncLLM`` makes in this process (unless ``--disable-log-stats`` is in ``--vllm-args``): the
  seconds each Encode request's items waited in the engine's scheduler before their batch started. Its
  ``_sum`` over ``_count`` between two scrapes is the mean queueing time. With the wait in front of the
  engine it is the local autoscaler's encoder signal, the time an item waited before its batch started:
  an encoder's busy share can stay near 1 while it keeps up, its queueing time cannot. Either half alone
  misses a shortage: on a CPU host the items waited in front of the engine (the processor) while the
  engine's own queue time read about 0 (bench/autoscale.py).

``LOAD`` is the process's one ``EncoderLoad``; the servicer's handlers feed it and a scrape reads it, both on
the service's event loop (``services.common.metrics_port``), so it takes no lock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.signals import DRAINING

__all__ = ["DRAINING", "LOAD", "EncoderLoad", "Pending"]


class Pending:
    """One Encode call's items in the queue depth, from admission until ``done`` (idempotent: the call's
    ``finally`` gives back whatever an early ``done`` did not); ``started`` once its engine request is
    submitted counts the call's wait in this service (decoding, the processor, the limits) to then."""

    def __init__(self, load: EncoderLoad, n: int) -> None:
        self._load, self._n = load, n
        self._admitted: float | None = load._clock()
        load.depth += n

    def started(self) -> None:
        """The call's engine request is submitted: the seconds since admission join the wait (once)."""
        if self._admitted is not None:
            self._load.waited(self._load._clock() - self._admitted)
            self._admitted = None

    def done(self) -> None:
        self._load.depth -= self._n
        self._n = 0


class EncoderLoad:
    """Items in the encoder (``depth``) and the seconds its engine was busy (``busy_seconds``). ``clock``:
    monotonic seconds (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.depth = 0
        self.wait_seconds = 0.0  # summed over the calls started: admission -> engine request submitted
        self.started = 0
        self._running = 0
        self._busy = 0.0
        self._since = 0.0

    def waited(self, seconds: float) -> None:
        """One call's wait in this service before its engine request (``Pending.started``)."""
        self.wait_seconds += max(0.0, seconds)
        self.started += 1

    def admit(self, n: int) -> Pending:
        """``n`` items entered: they count in the depth until the returned handle's ``done``."""
        return Pending(self, n)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One engine request in flight for the body of the ``with``: the engine is busy while any is."""
        if self._running == 0:
            self._since = self._clock()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._busy += self._clock() - self._since

    def busy_seconds(self) -> float:
        """Busy seconds so far, the stretch still running included."""
        return self._busy + (self._clock() - self._since if self._running else 0.0)


class _LoadCollector(Collector):
    """Reads ``EncoderLoad`` at each scrape."""

    def __init__(self, load: EncoderLoad) -> None:
        self._load = load

    def collect(self):
        yield GaugeMetricFamily("epd_encoder_queue_depth", "Items admitted by Encode and not yet encoded "
                                "(waiting plus running)", value=self._load.depth)
        yield CounterMetricFamily("epd_encoder_busy_seconds", "Seconds the encoder engine had at least one "
                                  "request; its rate is the busy share, 0 to 1", value=self._load.busy_seconds())
        yield CounterMetricFamily("epd_encoder_service_wait_seconds", "Seconds Encode calls waited in this service "
                                  "from admission until their engine request was submitted, summed",
                                  value=self._load.wait_seconds)
        yield CounterMetricFamily("epd_encoder_engine_requests", "Encode calls whose engine request was submitted",
                                  value=self._load.started)


LOAD = EncoderLoad()
REGISTRY.register(_LoadCollector(LOAD))
