"""``LocalState``: the limits of one gateway process, in its memory (no store configured).

Where the truth lives: in this object, on the process's event loop; every reader sees it exact and at
once. Nothing is ever unreachable. It is today's single-process behaviour: a limit holds for this
process, which is the whole front door when there is one process.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Mapping

from services.gateway.state.base import Lease, SharedState, check_limits, count, fits, uncount
from services.gateway.state.bucket import Buckets


class LocalState(SharedState):
    """Counts, leases and rate buckets in this process (the module docstring); ``try_acquire`` for callers
    that are not coroutines."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the rates' (seconds, monotonic)."""
        super().__init__()
        self._held: collections.Counter[str] = collections.Counter()
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count()
        self._buckets = Buckets(clock)

    async def acquire(self, limits: Mapping[str, int | None], amount: int = 1, force: bool = False) -> Lease | None:
        return self.try_acquire(limits, amount, force)

    def try_acquire(self, limits: Mapping[str, int | None], amount: int = 1, force: bool = False) -> Lease | None:
        """``acquire`` without a wait (this state never waits): for a caller that is not a coroutine."""
        check_limits(limits, amount)
        if not force and not fits(self._held, limits, amount):
            return None
        lease = Lease(str(next(self._ids)), tuple(limits), amount)
        self._leases[lease.id] = lease
        count(self._held, lease)
        return lease

    def release(self, lease: Lease) -> None:
        if self._leases.pop(lease.id, None) is None:
            return
        uncount(self._held, lease)
        self.freed.notify(lease.keys)

    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        return {key: self._held[key] for key in keys}

    async def take(self, bucket: str, items: int, per_minute: int) -> float:
        return self._buckets.take(bucket, items, per_minute)

    def charge(self, bucket: str, items: int, per_minute: int) -> None:
        self._buckets.charge(bucket, items, per_minute)

    def give_back(self, bucket: str, items: int, per_minute: int) -> None:
        self._buckets.give_back(bucket, items, per_minute)

    async def close(self) -> None:
        for lease in list(self._leases.values()):
            self.release(lease)
