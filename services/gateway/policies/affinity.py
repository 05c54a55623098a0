"""``--encoder-routing affinity``: an item goes to the encoder its content hash maps to by rendezvous
hashing, unless that encoder has more than ``--affinity-spill`` calls beyond the least busy
(``routing.pick_encoder``). Watches nothing, remembers nothing."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.instances import Instance
from services.gateway.policies.base import EncoderPolicy
from services.gateway.routing import pick_encoder


class AffinityPolicy(EncoderPolicy):
    def pick(self, key: str, candidates: Sequence[Instance]) -> Instance | None:
        return pick_encoder(key, candidates, self.cfg.affinity_spill, None, self.cfg.held_spill)
