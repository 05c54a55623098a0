"""``--lm-routing load``: the LM with the fewest outstanding calls, ties broken by rendezvous hashing of
the request's routing key (``routing.LeastOutstanding``). No prefix keys, watches nothing, remembers
nothing, counts no routing decision."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.instances import Instance
from services.gateway.policies.base import LMPolicy, LMRequest
from services.gateway.routing import LeastOutstanding

LEAST = LeastOutstanding()
"""Stateless: shared by every policy object."""


class LoadPolicy(LMPolicy):
    def pick(self, candidates: Sequence[Instance], request: LMRequest) -> Instance | None:
        return LEAST.pick(candidates, request.key)
