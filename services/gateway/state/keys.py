"""The names of the counts and rates the gateway's limits are decided on, one place for every user of a
``SharedState`` (``services.gateway.admission``, ``services.gateway.background``), so that every gateway
process (workers and replicas, whatever their version within one deployment) counts a place under the same
name. A tenant's name is part of its keys as the keys file spells it; the store keeps it as data (a hash
field, a JSON string), never as a pattern.

Admission (one ``acquire`` per admitted request, over ``LM``, ``ENCODER`` when it encodes on an encoder,
and its tenant's ``in_flight``):

- ``LM``: admitted requests on the LMs (``--lm-max-outstanding`` per generating LM).
- ``ENCODER``: admitted requests that encode on an encoder (``--encoder-max-outstanding`` per encoder).
- ``in_flight(tenant)``: the tenant's admitted requests (its ``max_in_flight``).
- ``lm(address)``: the requests running on that LM (``--lm-max-outstanding`` on each one; taken by routing
  once it has picked the LM: ``services.gateway.lm_places``).
- ``images(tenant)``: the tenant's ``images_per_minute`` bucket (``take``, ``charge``, ``give_back``).

Background Responses requests (one ``acquire`` per place, from its reservation until its LM reports the
work ended): ``BACKGROUND`` (``--lm-max-background`` per generating LM) and ``background(tenant)`` (its
share, or its ``max_background``).
"""

from __future__ import annotations

LM = "admission:lm"
ENCODER = "admission:encoder"
BACKGROUND = "background"


def in_flight(tenant: str) -> str:
    return f"admission:tenant:{tenant}"


def lm(address: str) -> str:
    return f"admission:lm:{address}"


def images(tenant: str) -> str:
    return f"images:tenant:{tenant}"


def background(tenant: str) -> str:
    return f"background:tenant:{tenant}"
