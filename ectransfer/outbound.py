"""The encoder's outbound store: encoded items waiting for their consumers.

Owner: the producer connector's scheduler half (encoder EngineCore process).
It ``adopt``s each slot it reserved once the worker reports the encoder output
written into it (``put`` copies a tensor in itself: tests, benchmarks); the
Transfer server reads slots while streaming.

**Claims.** Every Encode call has a claim: a random token the encoder service
makes per call, hands to vLLM with the encode request and sends to the LM in
each item's metadata. The encode request claims the copy of each of its items
(``claim``, or the reservation it makes, handed to ``adopt``); the LM names its
claim in Reserve, Ack and Cancel. A copy is held while it has a claim, and its
slot is freed exactly when

- its last claim is settled -- the consumer holding it acked (``ack``) or
  cancelled (``cancel``), or its encode request was aborted (``drop_claim``) --
  and nobody reads the slot (``begin_send``/``end_send``: a chunk stream in
  progress, or an in-place reader that has not acked); or
- its lease runs out (``ttl_s`` since it was made, or since an in-place
  reader's stream was lost: that reader may still be copying) and nobody reads it.

Nothing is guessed: a Cancel names its claim, so it drops that claim and no
other, whenever it comes. A claim settled before its encode request claimed the
copy (an LM that found the image in its prefix cache while the encoder still
encodes) is remembered as settled by (claim, identifier), and the encode's
later claim is not added; a Reserve for a settled claim is answered at once
(``settled``). These records are bounded (``max_settled_claims``, oldest
forgotten first, with a rate-limited log line): a forgotten one only means a
copy nobody wants waits out its lease.

At most one copy of an identifier is held: an encode of an item already held
claims that copy, and a copy adopted while another is held is merged into it
(its slot freed at once). Each copy has its own number (``OutboundItem.copy``),
sent in the ItemHeader and named back in the Ack: an Ack of an earlier copy
settles its claim and frees nothing else.

The claim ``""`` is anonymous (peers and tests that name none): it is never
recorded as settled, so a later copy for ``""`` is always kept.

**The host tier** (``keep_bytes`` > 0: the encoder's ``--host-tier-mib``;
bookkeeping in ``ectransfer.host_tier``). A settled, unread copy is kept (KEPT,
no lease, no claim) instead of freed; the next encode of its identifier claims
it back (a tier hit: no slot, no vision run). Kept copies go least recently used
first past ``keep_bytes``, and whenever a reservation needs the room
(``try_alloc``: never backpressure). ``generation`` moves with every change of
the identifiers held or kept, which ``identifiers`` lists for announcements.

``put`` on a full pool blocks up to ``put_timeout_s``, then drops the item with
a log line; a consumer asking for it then gets ``TIMED_OUT``. ``mark_failed``
answers waiters of an item that will never arrive.

The lifecycle of a copy (``CopyState``, ``TRANSITIONS``; the RESERVED stage
lives in ``ectransfer.connector.producer``)::

    RESERVED --adopt--> HELD <--claim / Reserve--> UNCLAIMED --last reader ends--> FREED
        |                 |                            |
        +--dropped--> FREED <--lease, nobody reading---+

    HELD / UNCLAIMED --settled, nobody reading, tier on--> KEPT --claim--> HELD
                                                           KEPT --evicted (LRU, by bytes)--> FREED

Every transition is made under the store's lock, on the thread that calls the
method (the engine's scheduler thread: ``adopt``, ``claim``, ``drop_claim``;
the Transfer server's loop: ``on_ready``, ``begin_send``, ``end_send``, ``ack``,
``cancel``, ``expire``).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ectransfer import tensors
from ectransfer.host_tier import HostTier
from ectransfer.pool import Pool, PoolFullError, Slot

logger = logging.getLogger(__name__)

ANONYMOUS = ""
"""The claim of peers that name none (never recorded as settled)."""


class CopyState(enum.Enum):
    RESERVED = "reserved"  # a slot is allocated, the encoder's worker writes it (producer.py)
    HELD = "held"  # in the store with at least one claim: served to Reserves, freed by acks/cancels/lease
    UNCLAIMED = "unclaimed"  # in the store, every claim settled, but someone still reads it (or may: a lost reader)
    KEPT = "kept"  # in the host tier: every claim settled, nobody reads it; the next claim takes it, or eviction
    FREED = "freed"  # the slot is back in the pool


TRANSITIONS: dict[CopyState, frozenset[CopyState]] = {
    CopyState.RESERVED: frozenset({CopyState.HELD, CopyState.UNCLAIMED, CopyState.FREED}),
    CopyState.HELD: frozenset({CopyState.UNCLAIMED, CopyState.KEPT, CopyState.FREED}),
    CopyState.UNCLAIMED: frozenset({CopyState.HELD, CopyState.KEPT, CopyState.FREED}),
    CopyState.KEPT: frozenset({CopyState.HELD, CopyState.UNCLAIMED, CopyState.FREED}),
    CopyState.FREED: frozenset(),
}

STRICT = os.environ.get("EPD_STRICT_TRANSITIONS", "") == "1"
"""Illegal transitions raise (tests set ``EPD_STRICT_TRANSITIONS=1``); in production they are logged."""


class IllegalTransition(RuntimeError):
    pass


def move(obj, new: CopyState) -> None:
    """Moves ``obj.state`` to ``new`` if ``TRANSITIONS`` allows it; otherwise
    raises (``STRICT``) or logs and leaves the state as it was."""
    old = obj.state
    if new in TRANSITIONS[old]:
        obj.state = new
        return
    msg = f"illegal copy transition {old.name} -> {new.name} for {getattr(obj, 'identifier', obj)!r}"
    if STRICT:
        raise IllegalTransition(msg)
    logger.error(msg)


@dataclass(eq=False)
class OutboundItem:
    """One copy of an item in the outbound pool. Its slot is owned by the store
    from ``adopt`` until freed (see the module docstring)."""

    identifier: str
    slot: Slot
    shape: tuple[int, ...]
    dtype: torch.dtype
    copy: int = 0
    """This copy's number, unique in the store: sent in the ItemHeader, named back in the Ack."""
    claims: set[str] = field(default_factory=set)
    readers: int = 0
    """Streams reading the slot, or consumers reading it in place: nothing frees it meanwhile."""
    created: float = field(default_factory=time.monotonic)
    """When the lease started: made, or an in-place reader's stream was lost."""
    pinned_until: float = 0.0
    """A lost in-place reader may copy until then: the slot is kept even unclaimed."""
    state: CopyState = CopyState.HELD
    settled_by: str = "cancel"
    """How its last claim went ("ack" or "cancel"): what its freeing counts as when a reader ends later."""

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes


@dataclass
class OutboundStats:
    items_put: int = 0
    items_reused: int = 0
    items_dropped: int = 0
    acks: int = 0
    cancels: int = 0
    expired: int = 0
    tier_hits: int = 0
    tier_evictions: int = 0

    def aggregate(self, other: OutboundStats) -> OutboundStats:
        return OutboundStats(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})


_FREE_COUNTERS = {"ack": "acks", "cancel": "cancels", "expired": "expired"}


class OutboundStore:
    def __init__(self, pool: Pool, *, ttl_s: float = 60.0, put_timeout_s: float = 30.0,
                 max_settled_claims: int = 16384, keep_bytes: int = 0) -> None:
        if max_settled_claims <= 0:
            raise ValueError(f"max_settled_claims must be > 0, got {max_settled_claims}")
        self.pool = pool
        self._tier: HostTier[OutboundItem] = HostTier(keep_bytes)
        self.generation = 0
        """Bumped whenever the set of identifiers held (claimed or kept) changes."""
        self.ttl_s = ttl_s
        self.put_timeout_s = put_timeout_s
        self.stats = OutboundStats()
        self._items: dict[str, OutboundItem] = {}
        self._waiters: dict[str, list[tuple[str, Callable[[OutboundItem | None], None]]]] = {}
        self._putting: dict[str, set[str]] = {}  # identifier -> claims of a put in progress
        self._failures: dict[str, str] = {}
        self._settled: OrderedDict[tuple[str, str], None] = OrderedDict()  # (claim, identifier)
        self._max_settled = max_settled_claims
        self._forgotten = 0
        self._logged_at = float("-inf")
        self._next_copy = 1
        self._lock = threading.Lock()

    # -- the producer (scheduler thread) --------------------------------------------------

    def put(self, identifier: str, tensor: torch.Tensor, claims: Iterable[str] = (ANONYMOUS,)) -> bool:
        """Copies ``tensor`` into a new slot held for ``claims`` (or adds them to
        the copy already held). Returns False if the item was dropped (pool full
        too long)."""
        with self._lock:
            if identifier in self._items or identifier in self._putting:
                self.stats.items_reused += 1
                item = self._items.get(identifier)
                if item is not None:
                    self._claim_locked(item, claims)
                else:
                    self._putting[identifier].update(claims)
                return True
            self._putting[identifier] = set(claims)
        try:
            data = tensors.as_bytes(tensor.detach(), keep_device=self.pool.buffer.device == tensor.device)
            try:
                slot = self.try_alloc(data.numel()) or self.pool.alloc(data.numel(), timeout=self.put_timeout_s)
            except PoolFullError as e:
                logger.error("dropping encoder output %s: %s", identifier, e)
                self.stats.items_dropped += 1
                return False
            self.pool.view(slot).copy_(data)
            with self._lock:
                claims = self._putting.pop(identifier, set())
            self.adopt(identifier, slot, tuple(tensor.shape), tensor.dtype, claims)
            return True
        finally:
            with self._lock:
                self._putting.pop(identifier, None)

    def adopt(self, identifier: str, slot: Slot, shape: tuple[int, ...], dtype: torch.dtype,
              claims: Iterable[str] = (ANONYMOUS,)) -> OutboundItem | None:
        """Takes ownership of a filled slot (the producer connector's second
        allocation stage) for ``claims`` and the consumers already waiting. A
        copy nobody claims any more is freed at once (counted as a cancel), or kept in the tier when it
        is on; one adopted while another is held is merged into it. Returns the held (or kept) copy,
        None if it was freed."""
        free = None
        with self._lock:
            self.stats.items_put += 1
            self._failures.pop(identifier, None)
            waiters = self._waiters.pop(identifier, [])
            wanted = {c for c in claims if not self._is_settled(c, identifier)}
            wanted.update(c for c, _ in waiters)
            item = self._items.get(identifier)
            evicted: list[OutboundItem] = []
            if item is not None:  # one copy per identifier: the new slot goes
                self._claim_locked(item, wanted)
                free = slot
            elif not wanted and not self._tier.fits(slot.nbytes):
                # every claim was settled (or dropped) before it landed, and nobody waits
                self.stats.cancels += 1
                free, item = slot, None
            else:
                item = OutboundItem(identifier, slot, tuple(shape), dtype, copy=self._next_copy, claims=wanted)
                self._next_copy += 1
                self._items[identifier] = item
                self.generation += 1
                if not wanted:  # settled before it landed: straight into the tier
                    self.stats.cancels += 1
                    evicted = self._keep_locked(item)
        if free is not None:
            self.pool.free(free)
        for victim in evicted:
            self.pool.free(victim.slot)
        for _, cb in waiters:
            cb(item)
        return item

    def claim(self, identifier: str, claim: str) -> bool:
        """An encode request with ``claim`` includes the item: True if the held
        copy (now claimed) or a settled claim covers it, False if a copy must be
        made (the caller reserves one and passes the claim to ``adopt``)."""
        with self._lock:
            if self._is_settled(claim, identifier):
                return True
            item = self._items.get(identifier)
            if item is None:
                return False
            if item.state is CopyState.KEPT:
                self.stats.tier_hits += 1
            self._claim_locked(item, (claim,))
            return True

    def try_alloc(self, nbytes: int) -> Slot | None:
        """A slot of ``nbytes`` from the pool, evicting kept copies (least recently used first) until it
        fits; None if it does not fit with the tier empty. Raises PoolFullError when ``nbytes`` is larger
        than the whole pool."""
        while True:
            slot = self.pool.try_alloc(nbytes)
            if slot is not None:
                return slot
            with self._lock:
                victim = self._pop_kept_locked()
            if victim is None:
                return None
            self.pool.free(victim.slot)

    def clear_tier(self) -> int:
        """Evicts every kept copy; returns how many."""
        n = 0
        while True:
            with self._lock:
                victim = self._pop_kept_locked()
            if victim is None:
                return n
            self.pool.free(victim.slot)
            n += 1

    def kept(self) -> tuple[int, int]:
        """(copies, bytes) in the host tier."""
        with self._lock:
            return len(self._tier), self._tier.nbytes

    def identifiers(self, limit: int = 4096) -> tuple[int, list[str]]:
        """(generation, up to ``limit`` identifiers held or kept, most recently used last): what the
        encoder announces it holds."""
        with self._lock:
            kept = self._tier.identifiers()[-limit:]
            held = [i for i, item in self._items.items() if item.state is not CopyState.KEPT]
            return self.generation, (kept + held)[-limit:]

    def drop_claim(self, identifier: str, claim: str) -> bool:
        """The encode request with ``claim`` was aborted: its claim goes (and
        stays settled). True if that freed the copy (counted as a cancel)."""
        return self._settle(identifier, claim, "cancel")

    def mark_failed(self, identifier: str, reason: str) -> None:
        """The item will never arrive: waiters are called with None and
        ``failure`` reports why (remembered for the last 1024 failures)."""
        with self._lock:
            self._failures[identifier] = reason
            while len(self._failures) > 1024:
                self._failures.pop(next(iter(self._failures)))
            waiters = self._waiters.pop(identifier, [])
        for _, cb in waiters:
            cb(None)

    # -- consumers (the Transfer server's loop) ------------------------------------------------

    def on_ready(self, identifier: str, claim: str, callback: Callable[[OutboundItem | None], None]) -> None:
        """Calls ``callback(copy)`` once the item is held, now claimed for
        ``claim`` too (at once if it is held), or ``callback(None)`` if it is
        marked failed. The callback runs on the adopting thread: keep it tiny."""
        with self._lock:
            item = self._items.get(identifier)
            if item is None and identifier not in self._failures:
                self._waiters.setdefault(identifier, []).append((claim, callback))
                return
            if item is not None:
                self._claim_locked(item, (claim,))
        callback(item)

    def forget_waiter(self, identifier: str, callback: Callable[[OutboundItem | None], None]) -> None:
        with self._lock:
            cbs = self._waiters.get(identifier)
            if cbs:
                cbs[:] = [(c, cb) for c, cb in cbs if cb != callback]
                if not cbs:
                    del self._waiters[identifier]

    def begin_send(self, identifier: str, claim: str = ANONYMOUS) -> OutboundItem | None:
        """A reader for ``claim`` starts on the held copy (None if none is held)."""
        with self._lock:
            item = self._items.get(identifier)
            if item is not None:
                item.readers += 1
                self._claim_locked(item, (claim,))
                if item.state is CopyState.KEPT:  # a settled claim reads it: out of the tier while read
                    self._tier.remove(item)
                    move(item, CopyState.UNCLAIMED)
            return item

    def end_send(self, item: OutboundItem, lost: bool = False) -> None:
        """One reader is done with ``item``'s slot. ``lost``: an in-place reader
        went away without an Ack or Cancel and may still be copying (its worker
        runs a step behind): the copy is kept a lease from now, claimed or not."""
        with self._lock:
            item.readers -= 1
            if lost:
                now = time.monotonic()
                item.created = now
                item.pinned_until = now + self.ttl_s
            slots = self._maybe_free_locked(item, item.settled_by)
        for slot in slots:
            self.pool.free(slot)

    def ack(self, identifier: str, claim: str = ANONYMOUS, copy: int = 0) -> bool:
        """The consumer with ``claim`` has the bytes of copy ``copy`` (0: not
        named). True if that freed the copy."""
        with self._lock:
            item = self._items.get(identifier)
            stale = copy and (item is None or item.copy != copy)
        if stale:
            logger.debug("ack of item %s copy %d, which is no longer held (its claim is settled)", identifier, copy)
        return self._settle(identifier, claim, "ack")

    def cancel(self, identifier: str, claim: str = ANONYMOUS) -> bool:
        """The consumer with ``claim`` will not read the item (a prefix-cache
        hit, an aborted request). True if that freed the copy."""
        return self._settle(identifier, claim, "cancel")

    def settled(self, identifier: str, claim: str) -> bool:
        """``claim`` was settled for the item (a Reserve for it is too late)."""
        with self._lock:
            return self._is_settled(claim, identifier) and not (
                identifier in self._items and claim in self._items[identifier].claims)

    def failure(self, identifier: str) -> str | None:
        with self._lock:
            return self._failures.get(identifier)

    def contains(self, identifier: str) -> bool:
        with self._lock:
            return identifier in self._items

    def held(self, identifier: str) -> OutboundItem | None:
        with self._lock:
            return self._items.get(identifier)

    def view(self, item: OutboundItem) -> torch.Tensor:
        return self.pool.view(item.slot)

    def expire(self, now: float | None = None) -> list[str]:
        """Frees copies whose lease ran out and that nobody reads (kept copies have no lease)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [i for i in self._items.values() if i.state is not CopyState.KEPT
                     and i.readers == 0 and now - i.created > self.ttl_s and now >= i.pinned_until]
            for item in stale:
                self._free_locked(item, "expired" if item.claims else None)
        for item in stale:
            self.pool.free(item.slot)
            if item.claims:
                logger.warning("outbound item %s expired after %.1fs without an ack (claims: %d)",
                               item.identifier, self.ttl_s, len(item.claims))
        return [i.identifier for i in stale]

    def settled_records(self) -> int:
        with self._lock:
            return len(self._settled)

    def snapshot(self) -> dict[str, int]:
        """``items``: copies held for a claim or a reader (not the kept ones: ``tier_items``)."""
        with self._lock:
            n = len(self._items) - len(self._tier)
            claims = sum(len(i.claims) for i in self._items.values())
            tier = {"tier_items": len(self._tier), "tier_bytes": self._tier.nbytes}
        return {"items": n, "claims": claims, **tier, **self.pool.stats(), **self.stats.__dict__}

    # -- under the lock ---------------------------------------------------------------------

    def _is_settled(self, claim: str, identifier: str) -> bool:
        return claim != ANONYMOUS and (claim, identifier) in self._settled

    def _claim_locked(self, item: OutboundItem, claims: Iterable[str]) -> None:
        for c in claims:
            if not self._is_settled(c, item.identifier):
                item.claims.add(c)
        if item.claims and item.state in (CopyState.UNCLAIMED, CopyState.KEPT):
            if item.state is CopyState.KEPT:
                self._tier.remove(item)
                item.created = time.monotonic()  # a new lease for the new claims
            move(item, CopyState.HELD)

    def _settle(self, identifier: str, claim: str, reason: str) -> bool:
        with self._lock:
            if claim != ANONYMOUS:
                self._settled[(claim, identifier)] = None
                self._settled.move_to_end((claim, identifier))
                self._evict_locked(identifier)
            item = self._items.get(identifier)
            if item is None or claim not in item.claims:
                return False
            item.claims.discard(claim)
            item.settled_by = reason
            slots = self._maybe_free_locked(item, reason)
            released = item.state in (CopyState.FREED, CopyState.KEPT)
        for slot in slots:
            self.pool.free(slot)
        return released

    def _maybe_free_locked(self, item: OutboundItem, reason: str) -> list[Slot]:
        """Takes ``item`` out (freed, or kept in the tier) if nothing holds it any more; returns the
        slots the caller frees outside the lock (the item's own, or kept copies evicted for it)."""
        if item.state in (CopyState.FREED, CopyState.KEPT) or item.claims:
            return []
        if item.readers or time.monotonic() < item.pinned_until:
            if item.state is CopyState.HELD:
                move(item, CopyState.UNCLAIMED)
            return []
        if self._tier.fits(item.slot.nbytes):
            counter = _FREE_COUNTERS[reason]
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            return [v.slot for v in self._keep_locked(item)]
        self._free_locked(item, reason)
        return [item.slot]

    def _keep_locked(self, item: OutboundItem) -> list[OutboundItem]:
        """Moves a settled, unread copy into the tier; returns the copies evicted for it (their slots are
        the caller's to free)."""
        move(item, CopyState.KEPT)
        evicted = self._tier.add(item)
        for victim in evicted:
            self._evicted_locked(victim)
        return evicted

    def _pop_kept_locked(self) -> OutboundItem | None:
        """Evicts the least recently kept copy (the caller frees its slot); None if the tier is empty."""
        victim = self._tier.pop_oldest()
        if victim is not None:
            self._evicted_locked(victim)
        return victim

    def _evicted_locked(self, victim: OutboundItem) -> None:
        self.stats.tier_evictions += 1
        self._free_locked(victim, None)

    def _free_locked(self, item: OutboundItem, reason: str | None) -> None:
        if self._items.get(item.identifier) is item:
            del self._items[item.identifier]
            self.generation += 1
        move(item, CopyState.FREED)
        if reason is not None:
            counter = _FREE_COUNTERS[reason]
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _evict_locked(self, identifier: str) -> None:
        evicted = 0
        while len(self._settled) > self._max_settled:
            self._settled.popitem(last=False)
            evicted += 1
        if evicted:
            self._forgotten += evicted
            now = time.monotonic()
            if now - self._logged_at >= 10.0:
                self._logged_at = now
                logger.warning("settled-claim records full (%d): %d oldest forgotten so far (a copy claimed by one "
                               "of them waits out its lease); last settled for item %s", self._max_settled,
                               self._forgotten, identifier)
