"""Refused calls on the internal ports: counted by reason, logged at a bounded rate.

Anyone who can reach an encoder's or an LM's internal port can make it refuse calls as fast as it
can send them. A log line per refusal would let that caller fill the disk and bury the lines that
matter, so ``Refusals`` counts every refusal (the Prometheus counter ``epd_peer_refused_total``, by
``reason``) and logs only the first ``burst`` refusals of each ``interval_s`` one by one; the rest of
that interval is summed up in one line, written with the next refusal after the interval ends (no
timer: a flood that stops leaves its last interval's count in the counter, not in the log).

Who calls it: ``peerauth.TokenInterceptor`` (a missing or wrong token, on every internal gRPC port)
and the encoder's Transfer server (``ectransfer.server``: a control-lane connection without a valid
lane secret), from whichever thread or event loop serves the call; a lock keeps the counts right.
``REFUSALS`` is the process's one instance: the counter lives in the process's default registry,
which the encoder and LM services serve on ``--metrics-port``. The Transfer server runs in the
encoder's vLLM EngineCore process, whose registry nobody serves: its refusals are in that process's
log lines (the encoder service's log) only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import Counter

logger = logging.getLogger(__name__)

REFUSED = Counter("epd_peer_refused_total", "Calls refused on an internal port for failed peer authentication",
                  ["reason"])

REASONS = {
    "no_token": "no auth token",
    "wrong_token": "a wrong auth token",
    "lane_secret": "no valid control-lane secret",
}
"""The counter's ``reason`` label values, and the words a log line says for each."""


class Refusals:
    """Counts refusals and logs them without letting a caller flood the log (module docstring).
    ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, burst: int = 5, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval_s, self._clock = burst, interval_s, clock
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._logged = 0
        self._quiet: Tally[str] = Tally()

    def refused(self, reason: str, what: str) -> None:
        """One refusal of ``what`` (a gRPC method, or "a control-lane connection") for ``reason``
        (a key of ``REASONS``): counted always, logged if this interval's burst is not spent."""
        REFUSED.labels(reason).inc()
        with self._lock:
            summary = self._roll(self._clock())
            log = self._logged < self.burst
            if log:
                self._logged += 1
            else:
                self._quiet[reason] += 1
            last = log and self._logged == self.burst
        if summary:
            logger.warning("%s", summary)
        if log:
            logger.warning("refused %s: %s%s", what, REASONS.get(reason, reason),
                           f" (the rest of this {self.interval_s:.0f} s interval's refusals are counted in "
                           "epd_peer_refused_total and summed up in one line)" if last else "")

    def _roll(self, now: float) -> str:
        """Starts a new interval once the current one is over; returns the summary line of the one
        that ended ("" when it logged every refusal). Called under the lock."""
        if self._window_start is not None and now - self._window_start < self.interval_s:
            return ""
        quiet, self._quiet = self._quiet, Tally()
        self._window_start, self._logged = now, 0
        if not quiet:
            return ""
        by_reason = ", ".join(f"{n} for {REASONS.get(r, r)}" for r, n in sorted(quiet.items()))
        return f"refused {sum(quiet.values())} more calls without logging each ({by_reason})"


REFUSALS = Refusals()
"""This process's refusals (module docstring)."""
