"""Routing primitives, kept free of I/O so tests can drive them directly; the policies
(``services.gateway.policies``) compose them with what the fleet remembers.

Encoders: cache affinity by content hash with rendezvous (highest random
weight) hashing, so a repeated image goes to the encoder that may still hold
its output and only 1/N of the keys move when an instance joins or leaves. The
affine encoder is skipped ("spill") when it has more than ``spill`` calls in
flight beyond the least-loaded healthy encoder. LMs: least outstanding calls,
ties broken by rendezvous hashing of the request's key. E -> P -> D: the decode LM among the
least busy ones is one on the prefill LM's host where there is one (the KV then moves within a
host: shared memory or NVLink rather than the network).

Every pick is a function of the request's key and the instances' addresses and outstanding calls
alone (no process-local counter or randomness), so two gateway replicas with the same view of the
fleet send the same request to the same instances.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from services.gateway.instances import Instance, split_host_port

DECISIONS = Counter("epd_gateway_encoder_routing_total",
                    "Encoder routing decisions: held (an encoder holds the item's output), affinity or spill",
                    ["decision"])


def _weight(key: str, inst: Instance) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{inst.address}".encode(), digest_size=8).digest(), "big")


def pick_encoder(key: str, candidates: Sequence[Instance], spill: int,
                 holds: Callable[[str], bool] | None = None, held_spill: int | None = None) -> Instance | None:
    """The encoder for an item whose content hash is ``key``. ``holds(address)``: that encoder holds the
    item's output (``services.fleet_memory``): the least busy such encoder wins within ``held_spill``
    (default ``spill``) of the least busy encoder (it claims the output: no vision run, where any other
    encoder would run one), else affinity within ``spill``, else the least busy."""
    if not candidates:
        return None
    weight = {i.address: _weight(key, i) for i in candidates}  # one hash per candidate
    affine = max(candidates, key=lambda i: weight[i.address])
    least = min(candidates, key=lambda i: (i.outstanding, -weight[i.address]))
    holders = [i for i in candidates if holds(i.address)] if holds is not None else []
    if holders:
        holder = min(holders, key=lambda i: (i.outstanding, -weight[i.address]))
        if holder.outstanding - least.outstanding <= (spill if held_spill is None else held_spill):
            DECISIONS.labels("held").inc()
            return holder
    if affine.outstanding - least.outstanding > spill:
        DECISIONS.labels("spill").inc()
        return least
    DECISIONS.labels("affinity").inc()
    return affine


class LeastOutstanding:
    """Least outstanding calls; ties broken by rendezvous hashing of the request's key: the same request
    on the same view lands on the same instance (on every gateway replica), different requests spread over
    the ties. Stateless: one object serves every request."""

    def pick(self, candidates: Sequence[Instance], key: str = "") -> Instance | None:
        if not candidates:
            return None
        return min(candidates, key=lambda i: (i.outstanding, -_weight(key, i)))


def pick_decode(prefill: Instance, decodes: Sequence[Instance], policy: LeastOutstanding,
                key: str = "") -> Instance | None:
    """The decode LM for a request (routing key ``key``) prefilled on ``prefill``: among the least busy
    decode LMs, one on the prefill LM's host where there is one (NIXL then moves the KV over shared memory
    or NVLink; it says nothing of where its peers are, so the address is what tells); ties broken by
    ``policy``."""
    if not decodes:
        return None
    least = min(d.outstanding for d in decodes)
    idle = [d for d in decodes if d.outstanding == least]
    host = split_host_port(prefill.address)[0]
    near = [d for d in idle if split_host_port(d.address)[0] == host]
    return policy.pick(near or idle, key)
