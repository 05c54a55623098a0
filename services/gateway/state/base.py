"""What the gateway's limits need of a state that several gateway processes may share: one interface,
``SharedState``, implemented by ``LocalState`` (one process, memory) and ``RedisState`` (a store).

Primitives, all called on the gateway's event loop of the process that holds the state:

Counted places (an LM's places, an encoder's, a tenant's ``max_in_flight``, its background places, its
body bytes):

- ``acquire(limits, amount=1, force=False) -> Lease | None``: takes ``amount`` on every key of ``limits``
  at once, only if each key with a limit (None: counted, not limited) stays within it; None (nothing
  taken) otherwise. ``force``: taken past the limits (bytes already received). The caller owns the
  lease and gives it back exactly once with ``release``.
- ``release(lease)``: gives the lease back; never blocks and never raises (a store is told in the
  background, so a ``Ticket.release`` stays synchronous). A second release of one lease is a no-op.
- ``counts(keys) -> dict``: what is held on each key, by every process (as fresh as the implementation's
  docstring says).

Rates (``images_per_minute``):

- ``take(bucket, items, per_minute) -> seconds``: takes ``items`` from a bucket that holds
  ``per_minute`` and refills at ``per_minute`` a minute: 0.0 when taken, else (nothing taken) the seconds
  until they will be there (``math.inf``: never, more than a minute's worth).
- ``charge(bucket, items, per_minute)``: items a request delivered after it was admitted (a speech
  upload's windows), taken whatever is left: the bucket may go below empty, and the next ``take`` waits
  until it has refilled past them; never blocks and never raises.
- ``give_back(bucket, items, per_minute)``: the items of a request that was not admitted after all;
  never blocks and never raises.

Places freed elsewhere (for a process whose waiters wait locally):

- ``wait_freed(timeout) -> bool``: returns once some place was released (in any process: True) or after
  ``timeout`` (False): a bounded poll when no word comes. ``on_freed(callback)``: the same word as a
  callback, with the keys freed.

Lifecycle: ``start()`` before the first call and ``close()`` after the last (optional hooks; ``close``
gives back every lease still held). A state holds no locks: everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """Places held on ``keys``, ``amount`` on each; ``id`` is unique within the process that took it."""

    id: str
    keys: tuple[str, ...]
    amount: int = 1

    def to_dict(self) -> dict:
        """The lease as the store keeps it (``RedisState``'s scripts read ``n`` and ``k``)."""
        return {"n": self.amount, "k": list(self.keys)}


def check_limits(limits: Mapping[str, int | None], amount: int) -> None:
    """Raises ValueError for an acquire that could take nothing meaningful."""
    if not limits:
        raise ValueError("acquire needs at least one key")
    if amount < 1:
        raise ValueError(f"amount must be >= 1, got {amount}")


def fits(held: Mapping[str, int], limits: Mapping[str, int | None], amount: int) -> bool:
    """Whether ``amount`` more on every key of ``limits`` keeps each limited key within its limit."""
    return all(limit is None or held.get(key, 0) + amount <= limit for key, limit in limits.items())


def count(held: collections.Counter, lease: Lease) -> None:
    """Adds ``lease``'s units to a process's own ``held`` counts (what it decides on alone)."""
    held.update(dict.fromkeys(lease.keys, lease.amount))


def uncount(held: collections.Counter, lease: Lease) -> None:
    """Takes ``lease``'s units out of ``held``; a key that holds nothing more is dropped."""
    held.subtract(dict.fromkeys(lease.keys, lease.amount))
    for key in lease.keys:
        if held[key] <= 0:
            del held[key]


class FreedSignal:
    """The word that a place was freed: ``notify`` wakes every ``wait`` and calls every callback. Owned by
    the state that emits it; lives on its event loop."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._callbacks: list[Callable[[frozenset[str]], None]] = []

    def add(self, callback: Callable[[frozenset[str]], None]) -> None:
        self._callbacks.append(callback)

    def notify(self, keys: Iterable[str]) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()
        freed = frozenset(keys)
        for callback in list(self._callbacks):
            try:
                callback(freed)
            except Exception:  # one listener's bug must not stop the others' word
                logger.exception("a freed-place listener failed")

    async def wait(self, timeout: float) -> bool:
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:  # TimeoutError's alias on 3.10
            return False
        return True


class SharedState(ABC):
    """See the module docstring: the primitives, who calls them and who owns a lease."""

    def __init__(self) -> None:
        self.freed = FreedSignal()

    async def start(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Connects and starts background tasks (none for a state in memory)."""

    async def close(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Gives back every lease still held and stops background tasks."""

    @property
    def shared(self) -> bool:
        """Whether decisions are made on the whole front door's counts now (False: this process's part)."""
        return True

    @abstractmethod
    async def acquire(self, limits: Mapping[str, int | None], amount: int = 1, force: bool = False) -> Lease | None:
        ...

    @abstractmethod
    def release(self, lease: Lease) -> None:
        ...

    @abstractmethod
    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        ...

    @abstractmethod
    async def take(self, bucket: str, items: int, per_minute: int) -> float:
        ...

    @abstractmethod
    def charge(self, bucket: str, items: int, per_minute: int) -> None:
        ...

    @abstractmethod
    def give_back(self, bucket: str, items: int, per_minute: int) -> None:
        ...

    async def wait_freed(self, timeout: float) -> bool:
        return await self.freed.wait(timeout)

    def on_freed(self, callback: Callable[[frozenset[str]], None]) -> None:
        self.freed.add(callback)
