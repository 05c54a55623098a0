"""Bytes counted against a bound, on one event loop: ``ByteBudget`` (an asyncio semaphore counted in
bytes) and ``DecodeLease`` (one request's share of it, released once).

Who uses it: every service's ``MediaDecoder`` (``services.common.media``) holds one for the decoded
bytes of its requests (first come first served); the gateway's intake (``services.gateway.intake``)
holds one for the request bodies it has read (any waiter that fits goes ahead). Whoever acquires bytes
releases them: a ``DecodeLease``'s holder calls ``release`` once what it counts is handed on (the
lease is idempotent); a waiter that times out or is cancelled holds nothing.
"""

from __future__ import annotations

import asyncio
import collections


class ByteBudget:
    """An asyncio semaphore counted in bytes. ``fifo`` (the decode budgets): first come first
    served, so a large request is not overtaken forever by small ones. Not ``fifo`` (the gateway's
    body budget): any waiter that fits goes ahead, so small bodies never wait behind a large one
    (a large one may wait its whole timeout). Used on one event loop."""

    def __init__(self, capacity: int, fifo: bool = True) -> None:
        self.capacity = capacity
        self.fifo = fifo
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests queued for room now (neither granted nor timed out)."""
        return len(self._waiters)

    async def acquire(self, nbytes: int, timeout: float) -> bool:
        """Takes ``nbytes`` (at most ``capacity``), waiting up to ``timeout``
        seconds; False if there was no room in time (nothing is held then)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes never fit a budget of {self.capacity}")
        if (not self._waiters or not self.fifo) and self.used + nbytes <= self.capacity:
            self.used += nbytes
            return True
        entry = (nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await entry[1]
            return True
        except BaseException as e:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()  # a large waiter at the head may have blocked smaller ones
            elif entry[1].done() and not entry[1].cancelled():
                self.release(nbytes)  # granted just as it timed out or was cancelled
            if isinstance(e, TimeoutError):
                return False
            raise

    def force(self, nbytes: int) -> None:
        """Takes ``nbytes`` at once, even past ``capacity`` (memory already held that must be counted);
        waiters get room again once enough is released."""
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._grant()

    def _grant(self) -> None:
        if not self.fifo:
            for entry in list(self._waiters):
                nbytes, fut = entry
                if self.used + nbytes <= self.capacity:
                    self._waiters.remove(entry)
                    if not fut.done():
                        self.used += nbytes
                        fut.set_result(None)
            return
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            nbytes, fut = self._waiters.popleft()
            if not fut.done():
                self.used += nbytes
                fut.set_result(None)


class DecodeLease:
    """A request's share of the decode budget: ``release`` it once the decoded
    media are handed on (idempotent); ``keep`` shrinks it once a decode's peak has passed."""

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._budget.release(self.nbytes)
            self.nbytes = 0

    def keep(self, nbytes: int) -> None:
        """Gives back all but ``nbytes`` of the share at once: a decode charged for its peak keeps only what
        its result holds (never more than the share)."""
        nbytes = max(0, min(nbytes, self.nbytes))
        if nbytes < self.nbytes:
            self._budget.release(self.nbytes - nbytes)
            self.nbytes = nbytes
