"""An instance's lifecycle in the gateway's pool: one enum (``InstanceState``) and one transition table
(``TRANSITIONS``), with the state a failed check (``ON_FAILURE``) and a NOT_SERVING answer
(``ON_NOT_SERVING``) lead to. Only ``services.gateway.instances.InstancePool`` moves an instance along it."""

from __future__ import annotations

import enum


class InstanceState(enum.Enum):
    """Where an instance stands with the pool; only ``InstancePool`` moves it, along ``TRANSITIONS``."""

    PENDING = "pending"
    """Not admitted since it was added: no passing check (and ``verify``) yet. Never routed to."""
    ADMITTED = "admitted"
    """Routed to."""
    EJECTED = "ejected"
    """Was admitted, then failed a check or a call. Still tried when every admitted instance is out
    (a health blip on a busy host)."""
    REFUSED = "refused"
    """Answers its health check, but ``verify`` refused it (an LM serving another model, an instance that
    refuses the gateway's credentials). Never routed to; verified again on each passing check."""
    DRAINING = "draining"
    """Was admitted, then answered NOT_SERVING: it is leaving and finishes what it has. Routed new work
    only when no LM is admitted or ejected (it still takes calls until it goes: better than refusing
    them); a failed check leaves it draining (it is expected to go); a passing check and ``verify``
    re-admit it (restarted at the same address)."""


TRANSITIONS = {
    InstanceState.PENDING: {InstanceState.PENDING, InstanceState.ADMITTED, InstanceState.REFUSED},
    InstanceState.ADMITTED: {InstanceState.ADMITTED, InstanceState.EJECTED, InstanceState.DRAINING},
    InstanceState.EJECTED: {InstanceState.EJECTED, InstanceState.ADMITTED, InstanceState.REFUSED,
                            InstanceState.DRAINING},
    InstanceState.REFUSED: {InstanceState.REFUSED, InstanceState.ADMITTED},
    InstanceState.DRAINING: {InstanceState.DRAINING, InstanceState.ADMITTED, InstanceState.REFUSED},
}
ON_FAILURE = {InstanceState.ADMITTED: InstanceState.EJECTED}
"""The state a failed check leads to (the same state where absent: a pending, refused or draining instance
stays as it is, with the new reason)."""
ON_NOT_SERVING = {InstanceState.ADMITTED: InstanceState.DRAINING, InstanceState.EJECTED: InstanceState.DRAINING}
"""The state a NOT_SERVING answer leads to (the same state where absent: a pending instance is not ready
yet, a refused one stays refused, a draining one goes on draining)."""
