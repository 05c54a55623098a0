"""Routing by what an LM holds: pure functions, tested alone (``tests/unit/test_fleet_memory.py``).

An LM's score for a request is the number of the request's media items whose blocks its prefix cache
holds (each such item's tokens, and the prompt before it when the conversation is the same one, need not
be computed again; with the images re-sent in a conversation's history, that is the history). The LM with
the highest score wins unless it has more than ``spill`` calls in flight beyond the least busy candidate:
then load wins (no hot spot). No LM holding anything: least outstanding, as before. Each decision and its
reason is a metric (``epd_gateway_lm_routing_total{decision}``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import Counter

DECISIONS = Counter("epd_gateway_lm_routing_total",
                    "LM routing decisions: held (an LM holds some of the request's items), spill (one did, but "
                    "was too busy) or load (none did: least outstanding)", ["decision"])


class Candidate(Protocol):
    address: str
    outstanding: int


class Holds(Protocol):
    def held(self, address: str, items: list[str]) -> int: ...


class Picker(Protocol):
    def pick(self, candidates: Sequence) -> Candidate | None: ...


def pick_lm(items: list[str], candidates: Sequence[Candidate], directory: Holds, policy: Picker,
            spill: int) -> tuple[Candidate | None, str]:
    """The LM for a request with media ``items`` among ``candidates``, and why ("held", "spill", "load")."""
    if not candidates:
        return None, "load"
    held = {c.address: directory.held(c.address, items) for c in candidates} if items else {}
    best = max(held.values(), default=0)
    if best == 0:
        return policy.pick(candidates), "load"
    holders = [c for c in candidates if held[c.address] == best]
    chosen = policy.pick([c for c in holders if c.outstanding == min(h.outstanding for h in holders)])
    least = min(c.outstanding for c in candidates)
    if chosen.outstanding - least > spill:
        return policy.pick(candidates), "spill"
    return chosen, "held"


def count(decision: str) -> None:
    DECISIONS.labels(decision).inc()
