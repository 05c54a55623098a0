"""Each LM's own places: ``--lm-max-outstanding`` held on the LM a request runs on, for the whole front door.

Admission (``services.gateway.admission``) decides whether a request runs at all: its pooled place
(``--lm-max-outstanding`` per generating LM, summed) is what a request waits for and what a full deployment
answers 503 with. It cannot bound one LM: it is taken before routing picks the LM, and every gateway
process routes on its own view (its own outstanding counts, its own health checks), so two replicas, or one
whose DNS still lags, can both send their share to the same LM. This place can: routing takes it on the LM
it picked, under that LM's key in the same ``SharedState`` (``state.keys.lm``), and an LM that is full for
the front door is passed over for the next pick.

Why a request never waits here: admission already holds the pooled place, and while every process counts
the same generating LMs, the admitted requests fit the LMs' places together (at most ``slots`` x LMs of
them), so some LM has one free. Where that does not hold (processes whose views of the fleet differ, a
request pinned to the LM that holds its stored response, a decode LM fixed by its prefill LM) the place is
taken anyway (``force``: counted, never refused; ``OVERFLOW`` counts it), because a request admitted is
never refused later.

Owner: the ``Orchestrator`` makes one over admission's state; each attempt takes its LM's place
(``take``) and gives it back when the attempt ends (``give_back``), failed or not.
"""

from __future__ import annotations

from prometheus_client import Counter

from services.gateway.instances import Instance
from services.gateway.state import keys
from services.gateway.state.base import Lease, SharedState

OVERFLOW = Counter("epd_gateway_lm_place_overflow_total",
                   "LM places taken past an LM's --lm-max-outstanding: every LM the request could use was full "
                   "for the front door (processes with different views of the fleet), or the request had to "
                   "use that LM (a stored response's, a prefill LM's decode LM)")


class LMPlaces:
    """Places per LM, ``slots`` each (0: none counted), on ``state`` (admission's: this process's memory,
    or the store the gateway processes share)."""

    def __init__(self, state: SharedState, slots: int) -> None:
        self.state, self.slots = state, slots

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    async def take(self, lm: Instance, force: bool = False) -> Lease | None:
        """A place on ``lm``; None when it has ``slots`` held across the front door. With ``force`` never None
        while places are counted: past the limit it is taken anyway, and ``OVERFLOW`` counts it. Nothing is
        held when places are not counted."""
        if not self.enabled:
            return None
        limits = {keys.lm(lm.address): self.slots}
        lease = await self.state.acquire(limits)
        if lease is None and force:
            OVERFLOW.inc()
            lease = await self.state.acquire(limits, force=True)
        return lease

    async def move(self, held: Lease | None, lm: Instance) -> Lease | None:
        """A place on ``lm`` for ``held``, which is given back: for an LM the request must use (a prefill LM's
        decode LM, fixed by the prefill LM), so taken past its limit if it must be (counted, never refused)."""
        place = await self.take(lm, force=True)
        self.give_back(held)
        return place

    def give_back(self, lease: Lease | None) -> None:
        if lease is not None:
            self.state.release(lease)
