"""Routing by what an LM holds: pure functions, tested alone (``tests/unit/test_fleet_memory.py``).

An LM's score for a request estimates the prompt tokens it would not compute again: the tokens up to the
longest of the request's prefix keys its prefix cache holds (``prefix``: the conversation so far, its images
included), plus ``ITEM_TOKENS`` for each media item after that prefix whose blocks it holds (a popular image
another conversation sent). The LM with the highest score wins unless it has more than ``spill`` calls in
flight beyond the least busy candidate: then load wins (no hot spot). No LM holding anything: least
outstanding, as before. Ties go to the ``Picker`` with the request's routing key (the gateway's breaks them
by rendezvous hashing of it: no process-local state). Each decision and its reason is a metric
(``epd_gateway_lm_routing_total{decision}``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import Counter

from services.fleet_memory.prefix import ITEM_TOKENS, NONE, Prefix

DECISIONS = Counter("epd_gateway_lm_routing_total",
                    "LM routing decisions: held (an LM holds some of the request's items), spill (one did, but "
                    "was too busy) or load (none did: least outstanding)", ["decision"])


class Candidate(Protocol):
    address: str
    outstanding: int


class Holds(Protocol):
    def held(self, address: str, items: list[str]) -> int: ...

    def holds(self, address: str, key: str) -> bool: ...


class Picker(Protocol):
    def pick(self, candidates: Sequence, key: str = "") -> Candidate | None: ...


def score(address: str, items: list[str], prefix: Prefix, directory: Holds) -> int:
    """The prompt tokens (estimated) the LM at ``address`` holds of a request with media ``items`` (in
    prompt order) and prefix keys ``prefix``."""
    tokens, covered = 0, 0
    for j in range(len(prefix.keys) - 1, -1, -1):  # the longest held prefix: its blocks come first
        if directory.holds(address, prefix.keys[j]):
            tokens, covered = prefix.tokens[j], prefix.items[j]
            break
    rest = items[covered:]
    return tokens + (ITEM_TOKENS * directory.held(address, rest) if rest else 0)


def pick_lm(items: list[str], candidates: Sequence[Candidate], directory: Holds, policy: Picker,
            spill: int, prefix: Prefix = NONE, key: str = "") -> tuple[Candidate | None, str]:
    """The LM for a request with media ``items``, prefix keys ``prefix`` and routing key ``key`` (what
    ``policy`` breaks ties by) among ``candidates``, and why ("held", "spill", "load")."""
    if not candidates:
        return None, "load"
    held = {c.address: score(c.address, items, prefix, directory) for c in candidates} \
        if items or prefix.keys else {}
    best = max(held.values(), default=0)
    if best == 0:
        return policy.pick(candidates, key), "load"
    holders = [c for c in candidates if held[c.address] == best]
    chosen = policy.pick([c for c in holders if c.outstanding == min(h.outstanding for h in holders)], key)
    least = min(c.outstanding for c in candidates)
    if chosen.outstanding - least > spill:
        return policy.pick(candidates, key), "spill"
    return chosen, "held"


def count(decision: str) -> None:
    DECISIONS.labels(decision).inc()
