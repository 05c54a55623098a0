"""The gateway's latency objectives as a scaling signal: the share of the requests finished in the last
``--objective-window-s`` seconds that met ``--objective-ttft-ms`` (time to first token) and
``--objective-tpot-ms`` (time per output token after the first), on the internal metrics port only.

- ``epd_gateway_objective_attainment{objective="ttft|tpot|both"}`` (gauge, 0..1): that share; 1 while the
  window holds no request (nothing was missed). Falling attainment asks for more capacity where the
  stage times (``epd_gateway_stage_seconds``) say the time went.
- ``epd_gateway_objective_window_requests`` and ``epd_gateway_objective_window_met{objective}`` (gauges):
  the counts behind it. With ``--workers N`` each worker keeps its own window; the page sums the counts
  over the live workers (exact: ``sum(met) / sum(requests)``) and shows the lowest worker's attainment.

Only successful requests (status 200) count, as for the stage histogram. A request with one output token
has no time per output token and meets that objective.

``AttainmentWindow`` is the pure part (tests drive it with their own clock). ``Objectives`` owns one and
the gauges; the process's one is ``OBJECTIVES``, set from the flags by ``configure`` when the gateway
starts, fed by ``services.gateway.metrics.observe`` for every finished request, and published again every
second by ``keep_published`` (a task the gateway's ``serve`` owns and cancels), so the share falls back as
the window slides past old requests even when no new one comes.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Gauge

OBJECTIVE_NAMES = ("ttft", "tpot", "both")

ATTAINMENT = Gauge("epd_gateway_objective_attainment", "Share of the requests finished in the last "
                   "--objective-window-s that met the objective (ttft: --objective-ttft-ms, tpot: --objective-tpot-ms, "
                   "both); 1 with no request in the window", ["objective"], multiprocess_mode="livemin")
WINDOW_REQUESTS = Gauge("epd_gateway_objective_window_requests", "Successful requests finished in the last "
                        "--objective-window-s", multiprocess_mode="livesum")
WINDOW_MET = Gauge("epd_gateway_objective_window_met", "Of those, the ones that met the objective",
                   ["objective"], multiprocess_mode="livesum")


@dataclass(frozen=True)
class Attainment:
    """A window's counts: ``requests`` finished, and how many met each objective."""

    requests: int = 0
    ttft: int = 0
    tpot: int = 0
    both: int = 0

    def met(self, objective: str) -> int:
        return getattr(self, objective)

    def share(self, objective: str) -> float:
        """The share that met ``objective`` (one of ``OBJECTIVE_NAMES``); 1.0 for an empty window."""
        return self.met(objective) / self.requests if self.requests else 1.0


class AttainmentWindow:
    """The requests finished in the last ``window_s`` seconds, kept as one bucket of counts per
    ``resolution_s`` (memory bounded by the window, whatever the request rate; the window's length is exact
    to within ``resolution_s``). ``clock``: monotonic seconds."""

    def __init__(self, window_s: float = 60.0, ttft_ms: float = 2000.0, tpot_ms: float = 200.0,
                 resolution_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttft_ms <= 0 or tpot_ms <= 0 or resolution_s <= 0 or window_s < resolution_s:
            raise ValueError(f"ttft_ms, tpot_ms and resolution_s must be > 0 and window_s >= resolution_s "
                             f"({resolution_s:g})")
        self.window_s, self.ttft_ms, self.tpot_ms = window_s, ttft_ms, tpot_ms
        self._resolution = resolution_s
        self._clock = clock
        self._buckets: collections.deque[list] = collections.deque()  # [slot, requests, ttft, tpot, both]
        self._totals = [0, 0, 0, 0]

    def record(self, ttft_ms: float, tpot_ms: float) -> None:
        """One successful request finished now, with these times (0: not measured, which meets it)."""
        ttft_ok, tpot_ok = ttft_ms <= self.ttft_ms, tpot_ms <= self.tpot_ms
        counts = (1, int(ttft_ok), int(tpot_ok), int(ttft_ok and tpot_ok))
        slot = int(self._clock() // self._resolution)
        self._expire(slot)
        if not self._buckets or self._buckets[-1][0] != slot:
            self._buckets.append([slot, 0, 0, 0, 0])
        bucket = self._buckets[-1]
        for i, n in enumerate(counts):
            bucket[i + 1] += n
            self._totals[i] += n

    def counts(self) -> Attainment:
        """The window's counts now."""
        self._expire(int(self._clock() // self._resolution))
        return Attainment(*self._totals)

    def _expire(self, slot: int) -> None:
        oldest = slot - int(self.window_s // self._resolution) + 1  # the slots still in the window
        while self._buckets and self._buckets[0][0] < oldest:
            gone = self._buckets.popleft()
            for i in range(4):
                self._totals[i] -= gone[i + 1]


class Objectives:
    """The process's window and the gauges it sets (``publish``)."""

    def __init__(self, window: AttainmentWindow | None = None) -> None:
        self.window = window or AttainmentWindow()

    def observe(self, ttft_ms: float, tpot_ms: float) -> None:
        self.window.record(ttft_ms, tpot_ms)
        self.publish()

    def publish(self) -> Attainment:
        counts = self.window.counts()
        WINDOW_REQUESTS.set(counts.requests)
        for name in OBJECTIVE_NAMES:
            ATTAINMENT.labels(name).set(counts.share(name))
            WINDOW_MET.labels(name).set(counts.met(name))
        return counts

    async def keep_published(self, period_s: float = 1.0) -> None:
        """Publishes every ``period_s`` until cancelled."""
        while True:
            self.publish()
            await asyncio.sleep(period_s)


OBJECTIVES = Objectives()


def configure(window_s: float, ttft_ms: float, tpot_ms: float) -> Objectives:
    """Sets the process's objectives from the gateway's flags (a fresh window) and returns them."""
    OBJECTIVES.window = AttainmentWindow(window_s, ttft_ms, tpot_ms)
    OBJECTIVES.publish()
    return OBJECTIVES


def keep_published(window_s: float, ttft_ms: float, tpot_ms: float) -> asyncio.Task:
    """``configure``, then a task that publishes the attainment every second until its owner (the gateway's
    ``serve``) cancels it at shutdown."""
    return asyncio.create_task(configure(window_s, ttft_ms, tpot_ms).keep_published(), name="objectives")
