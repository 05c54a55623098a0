"""The encoder's outbound store: encoded items waiting for their consumer.

Owner: the producer connector's scheduler half (encoder EngineCore process).
It ``adopt``s each slot it reserved once the worker reports the encoder output
written into it (``put`` copies a tensor in itself: tests, benchmarks); the
transfer server reads slots while streaming, and each slot is freed by exactly
one of: the consumer's Ack, its Cancel, or the lease expiring (``ttl_s``
without an Ack, e.g. the consumer died). A slot someone still reads (a chunk
stream in progress, or a consumer that reads shm / CUDA IPC memory in place and
has not acked yet: ``begin_send``/``end_send``) is never expired, and a release
meanwhile (another consumer's Ack) takes the item out of the store at once but
frees the slot only when the last reader ends. ``put`` on a full pool blocks up to
``put_timeout_s``, then drops the item with a log line; a consumer asking for
it then gets ``NOT_FOUND``/``TIMED_OUT``. ``mark_failed`` answers waiters of
an item that will never arrive.

Records a consumer can grow by naming identifiers (Cancels of items not held
here, kept for a copy still to come) are bounded: at most
``max_cancel_records`` identifiers per kind, the oldest evicted first, and
``max_cancels_per_item`` cancels per identifier, the oldest dropped first, each
with a (rate-limited) log line. An evicted cancel only means a copy nobody
wants waits out its lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ectransfer import tensors
from ectransfer.pool import Pool, PoolFullError, Slot

logger = logging.getLogger(__name__)


@dataclass
class OutboundItem:
    identifier: str
    slot: Slot
    shape: tuple[int, ...]
    dtype: torch.dtype
    created: float = field(default_factory=time.monotonic)
    sending: int = 0  # streams reading the slot, or consumers reading it in place; a lease never frees it meanwhile
    released: bool = False  # out of the store; the slot is freed when ``sending`` drops to 0
    cancel_at: float = 0.0  # freed as cancelled then, unless served first (a late Cancel, see adopt)
    served: bool = False  # a consumer has asked for it, read it or is reading it


@dataclass
class OutboundStats:
    items_put: int = 0
    items_reused: int = 0
    items_dropped: int = 0
    acks: int = 0
    cancels: int = 0
    expired: int = 0

    def aggregate(self, other: OutboundStats) -> OutboundStats:
        return OutboundStats(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})


_RELEASE_COUNTERS = {"ack": "acks", "cancel": "cancels", "expired": "expired"}


class OutboundStore:
    def __init__(self, pool: Pool, *, ttl_s: float = 60.0, put_timeout_s: float = 30.0,
                 max_cancel_records: int = 4096, max_cancels_per_item: int = 64) -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self.put_timeout_s = put_timeout_s
        self.stats = OutboundStats()
        self._items: dict[str, OutboundItem] = {}
        self._waiters: dict[str, list[Callable[[OutboundItem], None]]] = {}
        self._putting: set[str] = set()
        self._failures: dict[str, str] = {}
        # Cancels per item, counted: each is one consumer request that will not read
        # the copy made for it. Several may come before the copies they mean (an LM
        # that finds the image cached answers before the encode ends), and each must
        # drop one copy, not all of them one. Kept ``cancel_memory_s`` at most.
        # The item is not held and was not freed lately: for the next copy.
        self._cancelled = _Counts("pending", max_cancel_records, max_cancels_per_item)
        # Released lately (ack, cancel, lease). A Cancel that finds one of these gone
        # is stale -- it was meant for the copy already freed -- and must not drop
        # the next publication of the same item, which another consumer may need.
        self._released: dict[str, None] = {}
        # Released copies whose in-place reader's stream closed: it may still be
        # copying (its worker runs a step behind), so they are freed a lease later.
        self._zombies: list[OutboundItem] = []
        # Cancels that found the item freed lately: maybe stale (meant for the
        # freed copy), maybe for the next copy still being encoded. The next copy
        # is kept only ``stale_cancel_grace_s`` (0.5 s) for a consumer to ask for it:
        # an LM normally asks before the encode ends; a late one gets NOT_FOUND and
        # the gateway re-encodes, while a full pool of unwanted copies stalls every encode.
        self._late_cancels = _Counts("late", max_cancel_records, max_cancels_per_item)
        self.stale_cancel_grace_s = 0.5
        self.cancel_memory_s = 10.0
        self._lock = threading.Lock()

    def put(self, identifier: str, tensor: torch.Tensor) -> bool:
        """Copies ``tensor`` into a new slot. Called on vLLM's model-runner
        thread; returns False if the item was dropped (pool full too long)."""
        with self._lock:
            if identifier in self._items or identifier in self._putting:
                self.stats.items_reused += 1
                return True
            self._putting.add(identifier)
            self._released.pop(identifier, None)
        try:
            data = tensors.as_bytes(tensor.detach(), keep_device=self.pool.buffer.device == tensor.device)
            try:
                slot = self.pool.alloc(data.numel(), timeout=self.put_timeout_s)
            except PoolFullError as e:
                logger.error("dropping encoder output %s: %s", identifier, e)
                self.stats.items_dropped += 1
                return False
            self.pool.view(slot).copy_(data)
            self.adopt(identifier, slot, tuple(tensor.shape), tensor.dtype)
            return True
        finally:
            with self._lock:
                self._putting.discard(identifier)

    def released_lately(self, identifier: str) -> bool:
        """The item was freed (acked, cancelled, expired) and no new copy has
        been reserved since: a consumer asking now is probably too late."""
        with self._lock:
            return identifier in self._released and identifier not in self._items

    def expect(self, identifier: str) -> None:
        """A new copy of the item is on its way (the producer reserved a slot for
        it): Cancels from now on are for this copy."""
        with self._lock:
            self._released.pop(identifier, None)

    def adopt(self, identifier: str, slot: Slot, shape: tuple[int, ...], dtype: torch.dtype,
              unwanted: bool = False) -> None:
        """Takes ownership of an already-filled slot (the producer connector's
        second allocation stage: reserved by the scheduler, written by the worker).
        ``unwanted``: every request it was encoded for was aborted; unless a
        consumer already waits for it, the slot is freed at once (a cancel)."""
        item = OutboundItem(identifier, slot, tuple(shape), dtype)
        with self._lock:
            self._released.pop(identifier, None)
            self.stats.items_put += 1
            self._failures.pop(identifier, None)
            waiters = self._waiters.pop(identifier, [])
            now = time.monotonic()
            if not waiters and (self._cancelled.take(identifier, now - self.cancel_memory_s) or unwanted):
                # Its consumer gave up before the encode finished (abort,
                # prefix-cache hit), or its encode request was aborted and nobody
                # asked for it: free it now instead of at lease expiry.
                self.stats.cancels += 1
                old, item = item, None
            else:
                late = not waiters and self._late_cancels.take(identifier, now - self.cancel_memory_s)
                if late:
                    # A consumer said "not needed" after the previous copy went and
                    # before this one was reserved: unless someone asks for it soon,
                    # this copy is for nobody (a lease would hold it a minute).
                    item.cancel_at = now + self.stale_cancel_grace_s
                item.served = bool(waiters)  # asked for: never ``release_unwanted``
                old = self._items.get(identifier)
                self._items[identifier] = item
            if old is not None:
                old.released = True
                if old.sending:
                    old = None  # its last reader frees it
        if old is not None:
            self.pool.free(old.slot)
        for cb in waiters:
            cb(item)

    def mark_failed(self, identifier: str, reason: str) -> None:
        """The item will never arrive: waiters are called with None and
        ``failure`` reports why (remembered for the last 1024 failures)."""
        with self._lock:
            self._failures[identifier] = reason
            self._cancelled.forget(identifier)  # nothing will arrive for it to drop
            while len(self._failures) > 1024:
                self._failures.pop(next(iter(self._failures)))
            waiters = self._waiters.pop(identifier, [])
        for cb in waiters:
            cb(None)

    def failure(self, identifier: str) -> str | None:
        with self._lock:
            return self._failures.get(identifier)

    def contains(self, identifier: str) -> bool:
        with self._lock:
            return identifier in self._items

    def on_ready(self, identifier: str, callback: Callable[[OutboundItem | None], None]) -> None:
        """Calls ``callback(item)`` once the item is in the store (at once if it
        is), or ``callback(None)`` if it is marked failed. The callback runs on
        the putting thread: keep it tiny."""
        with self._lock:
            item = self._items.get(identifier)
            if item is None and identifier not in self._failures:
                self._waiters.setdefault(identifier, []).append(callback)
                return
            if item is not None:
                item.served = True  # asked for: never ``release_unwanted``
        callback(item)

    def release_unwanted(self, identifier: str) -> bool:
        """Frees the held copy of ``identifier`` if no consumer ever asked for it
        (none waits, reads or has read it): the producer calls this when every
        request that encoded it was aborted. Counted as a cancel. False if it is
        not held or someone asked for it (then an Ack or the lease frees it)."""
        with self._lock:
            item = self._items.get(identifier)
            if item is None or item.served or item.sending or self._waiters.get(identifier):
                return False
            del self._items[identifier]
            _remember(self._released, identifier)
            self.stats.cancels += 1
            item.released = True
        self.pool.free(item.slot)
        return True

    def forget_waiter(self, identifier: str, callback: Callable[[OutboundItem], None]) -> None:
        with self._lock:
            cbs = self._waiters.get(identifier)
            if cbs and callback in cbs:
                cbs.remove(callback)
                if not cbs:
                    del self._waiters[identifier]

    def begin_send(self, identifier: str) -> OutboundItem | None:
        with self._lock:
            item = self._items.get(identifier)
            if item is not None:
                item.sending += 1
                item.served = True
            return item

    def end_send(self, item: OutboundItem, restart_lease: bool = False) -> None:
        """One reader is done with ``item``'s slot. The last reader of a released
        item frees its slot. ``restart_lease``: an in-place reader went away
        without an ack (its stream closed) and may still be copying: the lease
        counts from now, and a released item is kept for a lease, not freed."""
        with self._lock:
            item.sending -= 1
            free = item.released and item.sending == 0
            if restart_lease:
                item.created = time.monotonic()
                if free:
                    self._zombies.append(item)
                    free = False
        if free:
            self.pool.free(item.slot)

    def view(self, item: OutboundItem) -> torch.Tensor:
        return self.pool.view(item.slot)

    def release(self, identifier: str, reason: str, held: OutboundItem | None = None) -> bool:
        """Frees the item's slot (reason: "ack", "cancel" or "expired").
        ``held``: the copy the caller read (an in-place reader's Ack); only that
        copy is released, never a newer one published under the same id."""
        if reason not in _RELEASE_COUNTERS:
            raise ValueError(f"unknown release reason {reason!r}; allowed: {sorted(_RELEASE_COUNTERS)}")
        with self._lock:
            if held is not None and self._items.get(identifier) is not held:
                return False  # that copy is gone already (another consumer's ack, a lease)
            current = self._items.get(identifier)
            if reason == "cancel" and held is None and current is not None and current.sending:
                # Another consumer is reading this copy: it is that consumer's (its Ack
                # frees it), so this Cancel means a copy still to come for another request.
                self._late_cancels.add(identifier, time.monotonic())
                return False
            item = self._items.pop(identifier, None)
            if item is None:
                if reason == "cancel" and identifier not in self._released:
                    # Not encoded yet: free it when it arrives.
                    self._cancelled.add(identifier, time.monotonic())
                elif reason == "cancel":
                    self._late_cancels.add(identifier, time.monotonic())
                return False
            _remember(self._released, identifier)
            counter = _RELEASE_COUNTERS[reason]
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            item.released = True
            busy = item.sending > 0  # another consumer still reads it: its end_send frees it
        if not busy:
            self.pool.free(item.slot)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Frees items older than the lease that nobody is sending right now,
        and released copies whose in-place reader went away a lease ago."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [i.identifier for i in self._items.values() if i.sending == 0 and now - i.created > self.ttl_s]
            unwanted = [i.identifier for i in self._items.values()
                        if i.cancel_at and i.sending == 0 and not i.served and now > i.cancel_at]
            done, kept = [], []
            for z in self._zombies:
                (done if z.sending == 0 and now - z.created > self.ttl_s else kept).append(z)
            self._zombies = kept
        for z in done:
            self.pool.free(z.slot)
        for ident in unwanted:
            if ident not in stale and self.release(ident, "cancel"):
                logger.info("outbound item %s freed: cancelled by a consumer and asked for by none", ident)
        for ident in stale:
            if self.release(ident, "expired"):
                logger.warning("outbound item %s expired after %.1fs without an ack", ident, self.ttl_s)
        return stale

    def cancel_records(self) -> int:
        """Cancels remembered for copies still to come (pending and late), all identifiers together."""
        with self._lock:
            return len(self._cancelled) + len(self._late_cancels)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            n = len(self._items)
        return {"items": n, **self.pool.stats(), **self.stats.__dict__}


def _remember(bounded: dict[str, None], identifier: str, limit: int = 4096) -> None:
    bounded[identifier] = None
    while len(bounded) > limit:
        bounded.pop(next(iter(bounded)))


class _Counts:
    """Timestamps of pending cancels per item, bounded: at most ``limit`` items
    (the oldest item goes first) and ``per_item`` cancels each (the oldest
    cancel goes first). Evictions are logged at most every ``_LOG_EVERY_S``."""

    _LOG_EVERY_S = 10.0

    def __init__(self, kind: str, limit: int = 4096, per_item: int = 64) -> None:
        if limit <= 0 or per_item <= 0:
            raise ValueError(f"cancel record limits must be > 0, got {limit} and {per_item}")
        self._by_id: dict[str, list[float]] = {}
        self._kind = kind
        self._limit = limit
        self._per_item = per_item
        self._evicted = 0
        self._logged_at = float("-inf")

    def __len__(self) -> int:
        return sum(len(stamps) for stamps in self._by_id.values())

    def add(self, identifier: str, now: float) -> None:
        stamps = self._by_id.setdefault(identifier, [])
        stamps.append(now)
        evicted = 0
        if len(stamps) > self._per_item:
            del stamps[0]
            evicted += 1
        while len(self._by_id) > self._limit:
            evicted += len(self._by_id.pop(next(iter(self._by_id))))
        if evicted:
            self._evicted += evicted
            if now - self._logged_at >= self._LOG_EVERY_S:
                self._logged_at = now
                logger.warning("%s cancel records full (%d items, %d each): %d oldest cancels forgotten so far; "
                               "last added for item %s", self._kind, self._limit, self._per_item, self._evicted,
                               identifier)

    def take(self, identifier: str, not_before: float) -> bool:
        """Consumes the oldest cancel of ``identifier`` made at or after ``not_before``."""
        stamps = self._by_id.get(identifier)
        if not stamps:
            return False
        while stamps and stamps[0] < not_before:
            stamps.pop(0)
        found = bool(stamps)
        if found:
            stamps.pop(0)
        if not stamps:
            del self._by_id[identifier]
        return found

    def forget(self, identifier: str) -> None:
        self._by_id.pop(identifier, None)
