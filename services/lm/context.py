"""One Generate call's epd state (``RequestContext``), reachable from vLLM's serving code.

The servicer makes a ``RequestContext`` per call and sets ``CURRENT`` in the call's task; vLLM's
serving code runs in that task (and in tasks it spawns, which copy the context), so the LM's
renderer, media connector and engine wrapper each find the request they serve and no other."""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.errors import EPDError
from services.common.layout import ItemLayout
from services.lm.handoff import Handoff

if TYPE_CHECKING:  # ectransfer.connector imports vLLM, which this module's importers must not pay for
    from ectransfer.connector.metadata import ItemSource
    from services.lm.media import RequestMedia


@dataclass
class RequestContext:
    """One Generate call's epd state, shared with vLLM's serving code through ``CURRENT``.

    ``layouts``/``sources``: per item identifier, the prompt layout and the encoder
    (``ItemSource``: endpoint, embedding width and dtype) from the encoders' metadata;
    empty for a request without encoder items. Written by the servicer before the call; read by
    ``LaidOutRenderer`` and ``ConsumerEngine``."""

    layouts: dict[str, ItemLayout] = field(default_factory=dict)
    sources: dict[str, ItemSource] = field(default_factory=dict)
    mm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Per item identifier, the metadata-only processed inputs (vLLM ``MultiModalKwargsItem``)
    the encoder sent for families that need them without the media (Qwen-VL's grid for M-RoPE)."""
    start: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    tokens: dict[int, int] = field(default_factory=dict)
    """Output tokens so far per choice index."""
    final: Any = None
    """The last engine output (vLLM ``RequestOutput``) of the request."""
    ec_report: dict | None = None
    """The consumer connector's report for the request (vLLM's ``RequestOutput.ec_transfer_params``),
    taken off the outputs before vLLM's serving code sees them: it is for the service (its facts and
    metrics), never part of an answer."""
    failure: EPDError | None = None
    """Why the engine failed the request, when a peer is to blame: an item's embedding could not be
    obtained (``EncoderUnavailable``) or, on a decode LM, the prompt's KV could not be loaded
    (``PrefillKVUnavailable``). The servicer turns it into the status with the ``epd-fault`` trailer
    (the gateway retries without that peer) instead of passing vLLM's error chunk on."""
    kv: Handoff = field(default_factory=Handoff)
    """The call's E -> P -> D hand-off (``services.lm.handoff``; phase 0: none, it prefills and decodes);
    DECODE: with the prefill LM's params, from the gateway (never from the request body)."""
    kv_report: dict | None = None
    """PREFILL: vLLM's kv params for the decode LM (``handoff.take_report``), taken off the outputs
    before vLLM's serving code sees them: the gateway's, never part of an answer."""
    submitted: bool = False
    """The request reached the engine (``ConsumerEngine.generate``)."""
    engine_calls: int = 0
    """Engine calls this request made (beam search makes one per beam per step; a hand-off takes one)."""
    prefix_key: str | None = None
    """The gateway's key of the request's prompt (``GenerateRequest.prefix_key``): vLLM's ``session_id`` for
    the request, which its KV events publish on each block the request stores (``services.fleet_memory``)."""
    laid_out: int = 0
    """Prompts of this call laid out from encoder metadata (0 or 1)."""
    media: RequestMedia | None = None
    """The media this LM decodes itself for the call (data: URLs from the gateway), under the
    service's media limits; None: it may decode none (``services.lm.media``)."""

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())

    @property
    def first_choice_tokens(self) -> int:
        return self.tokens.get(0, 0)


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("epd_lm_request", default=None)
