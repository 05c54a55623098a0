"""Routing decisions, kept free of I/O so tests can drive them directly.

Encoders: cache affinity by content hash with rendezvous (highest random
weight) hashing, so a repeated image goes to the encoder that may still hold
its output and only 1/N of the keys move when an instance joins or leaves. The
affine encoder is skipped ("spill") when it has more than ``spill`` calls in
flight beyond the least-loaded healthy encoder. LMs: least outstanding calls,
ties broken round robin.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from prometheus_client import Counter

from services.gateway.instances import Instance

DECISIONS = Counter("epd_gateway_encoder_routing_total", "Encoder routing decisions (affinity or spill)",
                    ["decision"])


def _weight(key: str, inst: Instance) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{inst.address}".encode(), digest_size=8).digest(), "big")


def pick_encoder(key: str, candidates: Sequence[Instance], spill: int) -> Instance | None:
    """The encoder for an item whose content hash is ``key``."""
    if not candidates:
        return None
    weight = {i.address: _weight(key, i) for i in candidates}  # one hash per candidate
    affine = max(candidates, key=lambda i: weight[i.address])
    least = min(candidates, key=lambda i: (i.outstanding, -weight[i.address]))
    if affine.outstanding - least.outstanding > spill:
        DECISIONS.labels("spill").inc()
        return least
    DECISIONS.labels("affinity").inc()
    return affine


class LeastOutstanding:
    """Least outstanding calls; a rotating start breaks ties round robin."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Instance]) -> Instance | None:
        if not candidates:
            return None
        start = next(self._turn) % len(candidates)
        rotated = list(candidates[start:]) + list(candidates[:start])
        return min(rotated, key=lambda i: i.outstanding)
