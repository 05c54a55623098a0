"""The bound on the Responses one LM stores: entries and bytes, the oldest ended ones forgotten first.

With ``VLLM_ENABLE_RESPONSES_API_STORE=1`` vLLM's Responses serving object (the app's
``state.openai_serving_responses``) keeps every stored response (``response_store``), the input
messages of each (``msg_store``, which a ``previous_response_id`` follow-up renders again: images
included, as data: URLs) and a background stream's events (``event_store``) in memory for the
life of the process: vLLM 0.32 has neither eviction nor a delete route (its own log warns of the
leak). ``StoredResponses`` bounds them. After every call of a Responses route the LM runs ``trim``:
it forgets the oldest *ended* responses (``completed``, ``failed``, ``cancelled``, ``incomplete``)
until at most ``--responses-store-max`` responses are stored and the ended ones weigh at most
``--responses-store-mib`` (each weighed once, when first seen ended: the JSON of the response and
of its input messages). A forgotten response answers as one vLLM never stored: ``GET`` and
``cancel`` 404, a ``previous_response_id`` naming it 404 (vLLM's own errors). Work in progress
(``queued``, ``in_progress``) is never forgotten; how much of it there is, the gateway bounds
(``--lm-max-background``, admission). A call that ends with no stored response (an error, a client
that left a stream) leaves input messages vLLM stored before it generated: ``forget_unstored``
drops them.

The stores are vLLM's: this class only weighs their entries and ``pop``s them, under the same
``response_store_lock`` vLLM's handlers take, by the attribute names vLLM 0.32 gives them
(``tests/unit/test_response_store.py`` checks those names in vLLM's source, so an upgrade that
renames one fails there, not silently here).

Owner: ``services.lm.server`` makes one per LM over its front end's app and gives it to the
servicer, which calls ``trim`` (and ``forget_unstored``) after each Responses call; everything runs
on the LM's event loop.
"""

from __future__ import annotations

import logging
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
        self._weights: dict[str, int] = {}  # ended responses held, oldest seen ended first
        self.nbytes = 0

    @classmethod
    def of_app(cls, app: Any, max_entries: int, max_bytes: int) -> StoredResponses:
        return cls(getattr(getattr(app, "state", None), "openai_serving_responses", None), max_entries, max_bytes)

    async def trim(self) -> None:
        if not self.enabled:
            return
        serving = self._serving
        async with serving.response_store_lock:
            store = serving.response_store
            for rid, response in store.items():
                if rid not in self._weights and getattr(response, "status", None) in ENDED:
                    n = weigh(response) + weigh(serving.msg_store.get(rid))
                    self._weights[rid] = n
                    self.nbytes += n
            forgotten = 0
            while self._weights and (len(store) > self.max_entries or self.nbytes > self.max_bytes):
                rid = next(iter(self._weights))
                self.nbytes -= self._weights.pop(rid)
                for name in STORES:
                    getattr(serving, name).pop(rid, None)
                forgotten += 1
            STORED.set(len(store))
        STORED_BYTES.set(self.nbytes)
        if forgotten:
            FORGOTTEN.inc(forgotten)
            logger.info("forgot %d stored response(s), the oldest ended (%d held, %d bytes; --responses-store-max "
                        "%d, --responses-store-mib %.0f)", forgotten, len(store), self.nbytes, self.max_entries,
                        self.max_bytes / (1 << 20))

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
