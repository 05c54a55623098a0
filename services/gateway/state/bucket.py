"""Token buckets in memory, one per name: ``LocalState``'s rates, and ``RedisState``'s while its store is
unreachable. A bucket holds ``per_minute`` items and refills at ``per_minute`` a minute (so a tenant idle
for a minute may send a minute's worth at once), the rule ``services.gateway.state.scripts.RATE`` applies
in the store. A bucket goes once it is full again, so only names that took items within the last minute
are kept. Owned by one state, on its event loop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class Buckets:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, monotonic (tests pass their own)."""
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # name: (items left, when)

    def _level(self, name: str, per_minute: int) -> float:
        left, at = self._buckets.get(name, (per_minute, 0.0))
        return min(float(per_minute), left + (self._clock() - at) * per_minute / 60.0)

    def take(self, name: str, items: int, per_minute: int) -> float:
        """0.0 if ``items`` were in the bucket (and are taken), else the seconds until they will be
        (``math.inf``: more than the bucket holds, or a bucket of nothing)."""
        if items > per_minute or per_minute <= 0:
            return math.inf
        level = self._level(name, per_minute)
        if level < items:
            return (items - level) * 60.0 / per_minute
        self._buckets[name] = (level - items, self._clock())
        return 0.0

    def charge(self, name: str, items: int, per_minute: int) -> None:
        """Takes ``items`` whatever is left (items a request delivered after it was admitted): the bucket may go
        below empty, and the next ``take`` waits until it has refilled past them."""
        if per_minute > 0:
            self._buckets[name] = (self._level(name, per_minute) - items, self._clock())

    def give_back(self, name: str, items: int, per_minute: int) -> None:
        if per_minute <= 0:
            return
        level = min(float(per_minute), self._level(name, per_minute) + items)
        if level >= per_minute:
            self._buckets.pop(name, None)
        else:
            self._buckets[name] = (level, self._clock())

    def __len__(self) -> int:
        return len(self._buckets)
