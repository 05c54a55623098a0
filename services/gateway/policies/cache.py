"""``--lm-routing cache``: the LM whose prefix cache holds most of a request's prompt (its longest held
prefix key and its media items: ``services.fleet_memory.scoring``) unless it has more than ``--lm-spill``
calls beyond the least busy; a request with neither media nor prefix keys by load alone, as ``load``.
What each LM holds comes from its ``Holdings`` (the pool polls them: ``watches``) and from what the
gateway sent it (``answered``), in the fleet's ``Directory``. Each scored decision is counted
(``epd_gateway_lm_routing_total{decision}``)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.routes import API
from services.fleet_memory import prefix, scoring
from services.gateway.instances import Instance
from services.gateway.lm_body import LMBody, tenant_salt
from services.gateway.policies.base import LMPolicy, LMRequest
from services.gateway.policies.load import LEAST


class CachePolicy(LMPolicy):
    watches = True

    def prefix(self, body: LMBody | None) -> prefix.Prefix:
        """A generating request's prefix keys, its media parts known by their content hashes and its
        tenant's salt folded in; none for an upload or an API that does not generate."""
        if body is None or not API[body.api].generates or API[body.api].upload:
            return prefix.NONE
        media_at = {(p.container, p.message, p.key, p.part): m.identifier
                    for p, m in zip(body.parts, body.media) if p.inner < 0}
        salt = tenant_salt(body.salt_tenant, body.body.get("cache_salt")) if body.salt_tenant else None
        return prefix.of_request(body.api, body.body, media_at, salt)

    def pick(self, candidates: Sequence[Instance], request: LMRequest) -> Instance | None:
        if not (request.items or request.prefix.keys):
            return LEAST.pick(candidates, request.key)
        lm, why = scoring.pick_lm(request.items, candidates, self.directory, LEAST, self.cfg.lm_spill,
                                  request.prefix, request.key)
        scoring.count(why)
        return lm

    def answered(self, lm: Instance, items: list[str], key: str = "") -> None:
        """``lm`` holds ``items`` and the prompt up to ``key`` until its next snapshot says."""
        self.directory.sent(lm.address, items + [key] if key else items)
