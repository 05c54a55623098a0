"""``--encoder-routing held``: an item goes to the least busy encoder whose outbound store or host tier
holds its output (no vision run), within ``--held-spill`` calls of the least busy encoder; else by cache
affinity, as ``affinity`` (``routing.pick_encoder``). What each encoder holds comes from its ``Holdings``
(the pool polls them: ``watches``) and from what the gateway sent it (``sent``), in the fleet's
``Directory``."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.instances import Instance
from services.gateway.policies.base import EncoderPolicy
from services.gateway.routing import pick_encoder


class HeldPolicy(EncoderPolicy):
    watches = True

    def pick(self, key: str, candidates: Sequence[Instance]) -> Instance | None:
        return pick_encoder(key, candidates, self.cfg.affinity_spill, self._holds(key), self.cfg.held_spill)

    def sent(self, encoder: Instance, items: list[str]) -> None:
        """Held from now on (until the encoder's next snapshot says): a concurrent request with the same
        item joins this encode there."""
        self.directory.sent(encoder.address, items)

    def _holds(self, key: str):
        return lambda address: self.directory.held(address, [key]) > 0
