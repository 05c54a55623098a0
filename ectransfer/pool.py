"""Bounded byte pools: the encoder's outbound pool and the LM's inbound staging.

Ownership (read this before touching a slot):

* ``OffsetAllocator`` only does arithmetic: first-fit ranges in ``[0, capacity)``
  with coalescing on free. Not thread-safe; the pool wraps it in a lock.
* ``Pool`` owns one backing buffer (host memory here; shared memory and GPU
  memory in the shm and CUDA IPC transports) and hands out ``Slot`` ranges.
  Whoever receives a ``Slot`` from ``alloc``/``try_alloc`` owns it and must
  ``free`` it exactly once. A full pool either returns ``None``
  (``try_alloc``) or blocks up to a timeout (``alloc``) -- that wait is the
  backpressure, nothing is dropped.
* Slots never move, so a descriptor (offset, nbytes) stays valid until freed.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass

import torch

from ectransfer.protocol import ProtocolError

ALIGNMENT = 256  # bytes; keeps every slot aligned for any dtype and for DMA


def check_range(offset: int, nbytes: int, size: int, what: str) -> None:
    """``[offset, offset + nbytes)`` lies inside a pool of ``size`` bytes;
    raises ProtocolError. Consumers call it on ranges a producer sent (uint64
    offsets, byte counts from int64 shapes) against the size of their own
    mapping: compared as Python ints, before any slicing or pointer math, so
    nothing wraps around."""
    if offset < 0 or nbytes < 0 or size < 0 or offset > size or nbytes > size - offset:
        raise ProtocolError(f"{what}: range {offset}+{nbytes} lies outside its {size} bytes")


class PoolFullError(Exception):
    """No room in the pool within the allowed wait."""


@dataclass(frozen=True)
class Slot:
    """A byte range in a pool. Owned by whoever allocated it until freed."""

    offset: int
    nbytes: int  # requested size (the allocator may round up internally)


class OffsetAllocator:
    """First-fit range allocator with coalescing. Pure bookkeeping."""

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size)
        self._used: dict[int, int] = {}  # offset -> rounded size

    def _round(self, n: int) -> int:
        return max(self.alignment, (n + self.alignment - 1) & ~(self.alignment - 1))

    def alloc(self, nbytes: int) -> int | None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = self._round(nbytes)
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not allocated")
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # Coalesce with the right neighbour, then the left one.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_off, prev_size = self._free.pop(i - 1)
            self._free[i - 1] = (prev_off, prev_size + self._free[i - 1][1])

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._used)

    def fits(self, nbytes: int) -> bool:
        return self._round(nbytes) <= self.capacity


class Pool:
    """A bounded pool of host memory handing out ``Slot`` ranges.

    Thread-safe. ``buffer`` is a flat uint8 tensor; subclasses (shared memory,
    GPU) provide a different backing buffer through ``_make_buffer``.
    """

    def __init__(self, capacity: int, alignment: int = ALIGNMENT, device: str = "cpu") -> None:
        self._alloc = OffsetAllocator(capacity, alignment)
        self._cond = threading.Condition()
        self._device = device
        self.buffer = self._make_buffer(capacity)

    def _make_buffer(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.uint8, device=self._device)

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    def try_alloc(self, nbytes: int) -> Slot | None:
        """Returns a slot or None when the pool has no room right now."""
        if not self._alloc.fits(nbytes):
            raise PoolFullError(f"{nbytes} bytes can never fit in a pool of {self.capacity} bytes")
        with self._cond:
            off = self._alloc.alloc(nbytes)
        return None if off is None else Slot(off, nbytes)

    def alloc(self, nbytes: int, timeout: float | None = None) -> Slot:
        """Blocks until ``nbytes`` fit (backpressure). Raises PoolFullError
        when ``timeout`` seconds pass first or the request can never fit."""
        if not self._alloc.fits(nbytes):
            raise PoolFullError(f"{nbytes} bytes can never fit in a pool of {self.capacity} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (off := self._alloc.alloc(nbytes)) is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolFullError(
                        f"pool full: {nbytes} bytes requested, {self._alloc.free_bytes} of "
                        f"{self.capacity} free (fragmented or in use) after {timeout}s"
                    )
                self._cond.wait(remaining)
        return Slot(off, nbytes)

    def free(self, slot: Slot) -> None:
        with self._cond:
            self._alloc.free(slot.offset)
            self._cond.notify_all()

    def view(self, slot: Slot) -> torch.Tensor:
        """The slot's bytes as a flat uint8 tensor sharing the pool's memory."""
        return self.buffer[slot.offset : slot.offset + slot.nbytes]

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "capacity_bytes": self.capacity,
                "used_bytes": self._alloc.used_bytes,
                "free_bytes": self._alloc.free_bytes,
                "allocations": self._alloc.num_allocations,
            }

    def close(self) -> None:
        """Releases the backing memory. Outstanding slots become invalid."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
