"""The host tier's bookkeeping: which settled copies the outbound store keeps, least recently used first.

Owner: ``ectransfer.outbound.OutboundStore``, which calls it under its own lock and owns the copies'
slots (it moves each copy's state and frees the slot of every copy this returns as evicted). This
class only orders the kept copies and counts their bytes against ``capacity_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class _Copy(Protocol):
    identifier: str

    @property
    def nbytes(self) -> int: ...


C = TypeVar("C", bound=_Copy)


class HostTier(Generic[C]):
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"the host tier's bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._copies: OrderedDict[str, C] = OrderedDict()

    def fits(self, nbytes: int) -> bool:
        """A copy of ``nbytes`` may be kept (the tier is on and the copy is not larger than it)."""
        return 0 < nbytes <= self.capacity_bytes

    def add(self, copy: C) -> list[C]:
        """Keeps ``copy`` as the most recently used; returns the oldest copies it pushed out (removed)."""
        self._copies[copy.identifier] = copy
        self.nbytes += copy.nbytes
        evicted = []
        while self.nbytes > self.capacity_bytes and (oldest := self.pop_oldest()) is not None:
            evicted.append(oldest)
        return evicted

    def remove(self, copy: C) -> None:
        """``copy`` leaves the tier (claimed again, or read): no-op if it is not kept."""
        if self._copies.get(copy.identifier) is copy:
            del self._copies[copy.identifier]
            self.nbytes -= copy.nbytes

    def pop_oldest(self) -> C | None:
        if not self._copies:
            return None
        _, copy = self._copies.popitem(last=False)
        self.nbytes -= copy.nbytes
        return copy

    def identifiers(self) -> list[str]:
        """Kept identifiers, least recently used first."""
        return list(self._copies)

    def __len__(self) -> int:
        return len(self._copies)
