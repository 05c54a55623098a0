"""The bound on the Responses one LM stores: entries and bytes, shared between tenants by weight, the
oldest ended responses of the tenant furthest over its share forgotten first.

With ``VLLM_ENABLE_RESPONSES_API_STORE=1`` vLLM's Responses serving object (the app's
``state.openai_serving_responses``) keeps every stored response (``response_store``), the input
messages of each (``msg_store``, which a ``previous_response_id`` follow-up renders again: images
included, as data: URLs) and a background stream's events (``event_store``) in memory for the
life of the process: vLLM 0.32 has neither eviction nor a delete route (its own log warns of the
leak). ``StoredResponses`` bounds them. After every call of a Responses route the LM runs ``trim``:
it records whose a response stored by that call is (the request's ``namespace``: its tenant, with
the tenant's ``tenant_weight``), then, while more than ``--responses-store-max`` responses are stored
or the ended ones weigh more than ``--responses-store-mib`` (each weighed once, when first seen ended:
the JSON of the response and of its input messages), forgets the oldest *ended* response
(``completed``, ``failed``, ``cancelled``, ``incomplete``) of the tenant furthest over its share.

A tenant's share of each bound is its weight's part of the weights of the tenants holding responses
here now (alone: all of it; beside one other of the same weight: half). Only a tenant over its share
loses responses, so a tenant that stores many evicts its own, and never another's that is within its
share; with one tenant (a gateway without keys) it is the oldest ended first. A forgotten response
answers as one vLLM never stored: ``GET`` and ``cancel`` 404, a ``previous_response_id`` naming it
404 (vLLM's own errors), to its owner alone (the gateway answers another tenant's id 404 before an LM
sees it), and nothing about it, or whose it was, reaches another tenant. Work in progress
(``queued``, ``in_progress``) counts towards its tenant's share but is never forgotten; how much of
it there is, the gateway bounds (``--lm-max-background``, admission), so a store can stay over a bound
while only work in progress is over. A call that ends with no stored response (an error, a client
that left a stream, ``store: false``) records nothing, and leaves input messages vLLM stored before
it generated: ``forget_unstored`` drops them.

The stores are vLLM's: this class only weighs their entries and ``pop``s them, under the same
``response_store_lock`` vLLM's handlers take, by the attribute names vLLM 0.32 gives them
(``tests/unit/test_response_store.py`` checks those names in vLLM's source, so an upgrade that
renames one fails there, not silently here). Its own books (each stored response's tenant, each
tenant's ended responses and weight) hold only responses in vLLM's store and tenants holding one.

Owner: ``services.lm.server`` makes one per LM over its front end's app and gives it to the
servicer, which calls ``trim`` (and ``forget_unstored``) after each Responses call; everything runs
on the LM's event loop.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pydantic_core
from prometheus_client import Counter, Gauge

logger = logging.getLogger(__name__)

ENDED = frozenset({"completed", "failed", "cancelled", "incomplete"})
STORES = ("response_store", "msg_store", "event_store")
"""vLLM 0.32's names for the serving object's three stores (``OpenAIServingResponses.__init__``)."""

STORED = Gauge("epd_lm_responses_stored", "Responses vLLM holds in its store on this LM")
STORED_BYTES = Gauge("epd_lm_responses_stored_bytes", "Weight of the ended responses held (JSON of the "
                     "response and its input messages)")
FORGOTTEN = Counter("epd_lm_responses_forgotten_total", "Stored responses forgotten to keep the store within "
                    "--responses-store-max / --responses-store-mib")


def weigh(obj: Any) -> int:
    """Bytes of ``obj`` as JSON (pydantic models, dicts, lists; anything else by its ``str``)."""
    if obj is None:
        return 0
    try:
        return len(pydantic_core.to_json(obj, fallback=str))
    except Exception:  # noqa: BLE001 - a weight, never an error: count what can be counted
        return len(str(obj))


class StoredResponses:
    def __init__(self, serving: Any, max_entries: int, max_bytes: int) -> None:
        """``serving``: vLLM's ``OpenAIServingResponses`` (None: this LM serves no Responses; every call
        is then a no-op), storing only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``."""
        self.enabled = serving is not None and bool(getattr(serving, "enable_store", False))
        self._serving = serving
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._owners: dict[str, str] = {}  # response id -> its tenant ("": none named, a gateway without keys)
        self._weights: dict[str, float] = {}  # tenant -> its weight, as its latest request carried it
        self._ended: dict[str, dict[str, int]] = {}  # tenant -> its ended responses held, oldest seen ended first
        self._bytes: dict[str, int] = {}  # tenant -> what its ended responses weigh
        self.nbytes = 0

    @classmethod
    def of_app(cls, app: Any, max_entries: int, max_bytes: int) -> StoredResponses:
        return cls(getattr(getattr(app, "state", None), "openai_serving_responses", None), max_entries, max_bytes)

    def held(self, tenant: str = "") -> int:
        """Responses of ``tenant`` in vLLM's store (ended or not)."""
        return sum(1 for t in self._owners.values() if t == tenant)

    async def trim(self, rid: str = "", tenant: str = "", weight: float = 0.0) -> None:
        """After a Responses call: ``rid`` (the id a POST named; empty for others), if vLLM stored it, is
        ``tenant``'s (the request's namespace), of ``weight`` (not above 0: 1); then the store is brought
        within its bounds (the module docstring)."""
        if not self.enabled:
            return
        serving = self._serving
        async with serving.response_store_lock:
            store = serving.response_store
            if rid and rid in store:
                self._owners[rid] = tenant
                self._weights[tenant] = weight if math.isfinite(weight) and weight > 0 else 1.0
            forgotten = self._shed(store, self._books(store))
            STORED.set(len(store))
        STORED_BYTES.set(self.nbytes)
        if forgotten:
            FORGOTTEN.inc(forgotten)
            logger.info("forgot %d stored response(s), the oldest ended of tenants over their share (%d held, "
                        "%d bytes; --responses-store-max %d, --responses-store-mib %.0f)", forgotten, len(store),
                        self.nbytes, self.max_entries, self.max_bytes / (1 << 20))

    def _books(self, store: dict) -> dict[str, int]:
        """Brings the books up to ``store`` (a response vLLM stored without a ``trim`` naming it is the
        tenant ""'s; one seen ended for the first time is weighed) and answers each tenant's responses held."""
        serving = self._serving
        for rid in [r for r in self._owners if r not in store]:
            self._drop(rid)
        held: dict[str, int] = {}
        for rid, response in store.items():
            tenant = self._owners.setdefault(rid, "")
            held[tenant] = held.get(tenant, 0) + 1
            ended = self._ended.setdefault(tenant, {})
            if rid not in ended and getattr(response, "status", None) in ENDED:
                n = weigh(response) + weigh(serving.msg_store.get(rid))
                ended[rid] = n
                self._bytes[tenant] = self._bytes.get(tenant, 0) + n
                self.nbytes += n
        for tenant in [t for t in self._weights if t not in held]:
            del self._weights[tenant]
        for tenant in [t for t, e in self._ended.items() if not e]:
            del self._ended[tenant]
            self._bytes.pop(tenant, None)
        return held

    def _shed(self, store: dict, held: dict[str, int]) -> int:
        """While ``store`` is over a bound, forgets the oldest ended response of the tenant furthest over its
        share of that bound (none over its share with one to forget: it stays over); answers how many went."""
        forgotten = 0
        while True:
            victim = self._over(held, held, self.max_entries) if len(store) > self.max_entries else None
            if victim is None and self.nbytes > self.max_bytes:
                victim = self._over(self._bytes, held, self.max_bytes)
            if victim is None:
                return forgotten
            self._forget(victim, held)
            forgotten += 1

    def _over(self, usage: dict[str, int], held: dict[str, int], bound: int) -> str | None:
        """The tenant furthest over its share of ``bound`` in ``usage`` (entries or bytes) that has an
        ended response to forget; None when no tenant over its share has one."""
        weight = {t: self._weights.get(t, 1.0) for t in held}
        total = sum(weight.values())
        over = [t for t in held if self._ended.get(t) and usage.get(t, 0) > bound * weight[t] / total]
        return max(over, key=lambda t: usage.get(t, 0) / weight[t], default=None)

    def _forget(self, tenant: str, held: dict[str, int]) -> None:
        """Forgets ``tenant``'s oldest ended response from every store of vLLM's."""
        rid = next(iter(self._ended[tenant]))
        for name in STORES:
            getattr(self._serving, name).pop(rid, None)
        self._drop(rid)
        held[tenant] -= 1
        if not held[tenant]:
            del held[tenant]

    def _drop(self, rid: str) -> None:
        """Takes ``rid`` off the books (no longer in vLLM's store)."""
        tenant = self._owners.pop(rid, "")
        n = self._ended.get(tenant, {}).pop(rid, None)
        if n is not None:
            self._bytes[tenant] -= n
            self.nbytes -= n

    async def forget_unstored(self, rid: str) -> None:
        """After a Responses POST whose id is ``rid`` ended: input messages vLLM stored for a response it did
        not store (the call failed, or its client left a stream) are dropped."""
        if not self.enabled or not rid:
            return
        serving = self._serving
        async with serving.response_store_lock:
            if rid not in serving.response_store:
                serving.msg_store.pop(rid, None)
                serving.event_store.pop(rid, None)
