"""The gateway's directory of what each LM's prefix cache holds, by media item and by prefix key
(``services.fleet_memory.prefix``), and of what each encoder's store holds, by item.

An LM's entry is its last ``Holdings`` snapshot (epoch, generation, items) plus the items the gateway sent
it since that snapshot was asked for ("sent": they will be in its cache once the request's prompt is
computed, and the next snapshot says whether they still are). The consistency rule: the LM's snapshot is
the truth; what the gateway adds on its own lives only until a snapshot asked for at least ``settle_s``
after the send (an item sent a moment before an ask may not have reached the LM's cache, or the
encoder's store, when it answers: its KV events or its encode still under way). So an LM that restarts
(a new epoch), loses events (a new epoch), or evicts an item is corrected at the next poll, and an LM that
leaves the pool is forgotten. An entry that is stale in between costs one miss (that LM computes the prompt
itself), never a wrong answer: the directory only steers routing.

Owner: the gateway's ``Fleet`` makes one, polls each admitted LM into it (``Fleet.poll_holdings``), and
forgets an LM the pool drops. Bounded: ``max_items`` per LM (a snapshot larger than that keeps its most
recent items) and ``max_lms`` LMs (a pool's size is bounded by its addresses; the bound is a backstop)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_ITEMS_PER_LM = 4096
MAX_LMS = 1024
SETTLE_S = 5.0
"""A sent item outlives snapshots asked for within this long after the send."""


@dataclass
class Entry:
    epoch: str = ""
    generation: int = -1
    items: frozenset[str] = frozenset()
    sent: dict[str, float] = field(default_factory=dict)
    """Items sent since the snapshot was asked for -> when (dropped by the next snapshot asked for later)."""
    asked_at: float = 0.0


class Directory:
    def __init__(self, max_items: int = MAX_ITEMS_PER_LM, max_lms: int = MAX_LMS, settle_s: float = SETTLE_S) -> None:
        self.max_items, self.max_lms, self.settle_s = max_items, max_lms, settle_s
        self._lms: dict[str, Entry] = {}

    def known(self, address: str) -> tuple[str, int]:
        """``(epoch, generation)`` of the snapshot held for ``address`` (``("", -1)``: none): what the
        next ``Holdings`` call sends, so an LM with nothing new answers without its items."""
        e = self._lms.get(address)
        return (e.epoch, e.generation) if e is not None else ("", -1)

    def update(self, address: str, epoch: str, generation: int, items: list[str] | None,
               asked_at: float | None = None) -> None:
        """An LM's answer to a ``Holdings`` call asked at ``asked_at``: ``items`` None when unchanged
        (same epoch and generation as ``known``), else the whole set held now."""
        asked_at = time.monotonic() if asked_at is None else asked_at
        e = self._lms.get(address)
        if e is None:
            if len(self._lms) >= self.max_lms:
                return
            e = self._lms[address] = Entry()
        if items is not None:
            e.epoch, e.generation = epoch, generation
            e.items = frozenset(items[-self.max_items:])
        # Sent well before the ask: the snapshot says. Sent just before it: it may not be there yet.
        e.sent = {i: t for i, t in e.sent.items() if t > asked_at - self.settle_s}
        e.asked_at = asked_at

    def sent(self, address: str, items: list[str], now: float | None = None) -> None:
        """The gateway sent a request with ``items`` to ``address`` and it answered."""
        if not items:
            return
        e = self._lms.get(address)
        if e is None:
            if len(self._lms) >= self.max_lms:
                return
            e = self._lms[address] = Entry()
        now = time.monotonic() if now is None else now
        for item in items:
            e.sent.pop(item, None)
            e.sent[item] = now
        while len(e.sent) > self.max_items:
            e.sent.pop(next(iter(e.sent)))

    def forget(self, address: str) -> None:
        self._lms.pop(address, None)

    def held(self, address: str, items: list[str]) -> int:
        """How many of ``items`` (a request's media identifiers) ``address`` holds, as far as is known."""
        e = self._lms.get(address)
        if e is None or not items:
            return 0
        return sum(1 for i in set(items) if i in e.items or i in e.sent)

    def holds(self, address: str, key: str) -> bool:
        """Whether ``address`` holds ``key`` (a media identifier or a prefix key), as far as is known."""
        e = self._lms.get(address)
        return e is not None and (key in e.items or key in e.sent)

    def addresses(self) -> list[str]:
        return list(self._lms)
