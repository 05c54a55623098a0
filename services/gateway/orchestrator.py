"""Runs one request across encoders and an LM, with failover.

One attempt: each image goes to an encoder (cache affinity, see
``routing``); in ``overlap`` dispatch ``Generate`` goes to the least-loaded LM
as soon as every encoder has streamed its items' metadata, so the LM tokenizes
and queues while the encoders still run (``sequential`` waits for "encoded").
Text-only requests go straight to an LM.

Failover happens only before the first token reaches the caller: an encoder
that fails or times out, or an LM that reports it could not get an item from
its encoder (the ``epd-fault: encoder`` trailer), costs a re-encode on another
encoder; an LM that fails costs a retry on another LM. An instance that
refuses the gateway (UNAUTHENTICATED, PERMISSION_DENIED: its token, certificate
or allow-list differs from its peers') is at fault as well: it is ejected and
re-verified, and the request retried elsewhere. Bad input and incompatible
peers are never retried. After the first token, a failure ends the stream with
the error. With no healthy encoder left, the LM encodes the items itself
(``local_encode_fallback``), which is plain vLLM's behaviour.

Peers may start in any order: the pools admit an instance once it passes its
health check (which needs no credentials) and its ``GetInfo`` (which does)
answers, so an instance that would refuse every call is never admitted; an LM's
``GetInfo`` must also name the served model (the first LM admitted teaches the
model unless ``--model-name`` is set). Until an LM is admitted, every request
fails at once with UNAVAILABLE and ``lm_wait_reason()``'s message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter

from epd.lm.v1 import lm_pb2
from peerauth import SecurityConfig
from services.common.media import off_loop
from services.fleet_memory.prefix import NONE, Prefix
from services.gateway import handoff
from services.gateway.admission import NO_QUOTA, Admission, Ticket
from services.gateway.config import GatewayConfig
from services.gateway.encoding import EncodeGroup, Encodes
from services.gateway.failures import Failure, rpc_error
from services.gateway.fleet import Fleet
from services.gateway.instances import Instance
from services.gateway.lm_body import LMBody
from services.gateway.lm_call import call_lm
from services.gateway.lm_places import LMPlaces
from services.gateway.state import SharedState
from services.gateway.state.base import Lease
from services.gateway.values import Media, Timings

logger = logging.getLogger(__name__)

RETRIES = Counter("epd_gateway_retries_total", "Attempts retried before the first token, by the role blamed",
                  ["role", "code"])
PLACEMENT = Counter("epd_gateway_placement_total", "Where image requests were encoded, and why",
                    ["choice", "reason"])


class Orchestrator:
    """Runs requests over the ``fleet`` (whose health loops start in ``start``): each attempt's encodes
    (``encoding``), its LM call (``lm_call``) or E -> P -> D hand-off (``handoff``), and the retries
    elsewhere that a failure allows (``failures``)."""

    def __init__(self, cfg: GatewayConfig, security: SecurityConfig | None = None, quota=None,
                 state: SharedState | None = None) -> None:
        """``quota``: a tenant's quotas (``Tenants.quota``), for admission; None: no tenant has any.
        ``state``: where admission and background places are counted (``services.gateway.state``; default:
        this process alone, in memory); its owner starts it before ``start`` and closes it after ``close``."""
        self.cfg = cfg
        self.fleet = Fleet(cfg, security)
        self.encodes = Encodes(cfg, self.fleet)
        self.releases = handoff.Releases()
        self.admission = Admission(
            cfg.lm_max_outstanding, cfg.encoder_max_outstanding if self.fleet.encoders is not None else 0,
            cfg.admission_queue, cfg.admission_wait_s, healthy_lms=self.fleet.generating_lms,
            healthy_encoders=self.fleet.healthy_encoders, quota=quota or (lambda tenant: NO_QUOTA), state=state)
        self.places = LMPlaces(self.admission.state, cfg.lm_max_outstanding)

    # The fleet's, for the front ends (/health, /v1/models, admission).
    @property
    def encoders(self):
        return self.fleet.encoders

    @property
    def lms(self):
        return self.fleet.lms

    @property
    def model(self) -> str | None:
        return self.fleet.model

    def generating_lms(self) -> int:
        return self.fleet.generating_lms()

    def lm_wait_reason(self) -> str | None:
        return self.fleet.lm_wait_reason()

    def health(self) -> dict[str, dict[str, bool]]:
        return self.fleet.health()

    def not_admitted(self) -> dict[str, dict[str, str]]:
        return self.fleet.not_admitted()

    def encodes_remotely(self, n_media: int) -> bool:
        return self.fleet.encodes_remotely(n_media)

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self.fleet.pools()))

    async def close(self) -> None:
        await self.admission.close()
        await self.encodes.close()
        await self.releases.close()
        await asyncio.gather(*(p.close() for p in self.fleet.pools()))

    async def generate(self, req: lm_pb2.GenerateRequest, media: list[Media], timings: Timings,
                       body: LMBody | None = None, ticket: Ticket | None = None, lm: str | None = None,
                       disaggregate: bool = True) -> AsyncIterator[lm_pb2.GenerateResponse]:
        """Yields the LM's responses. Raises grpc.aio.AioRpcError (from either
        service, or made here) once retries are exhausted or not allowed.
        ``body``: what each LM attempt's OpenAI body is rendered from, once the attempt's items have
        their sources (None: ``req.openai.body`` goes as it is). ``ticket``:
        the request's admission (its encoder slot is given back when the
        images are encoded on the LM). ``lm``: the LM that must answer (it holds
        state the request refers to, a stored response); no other is tried. ``disaggregate``: the
        request may go E -> P -> D (a generating route; not tokenize, say)."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        excluded = {"encoder": set(), "lm": set()}
        keys, key = NONE, ""  # a pinned request goes where it must
        if lm is None:  # its prefix keys, and what ties between equally busy LMs go by (every replica agrees)
            # Only without a body is ``req.openai.body`` read: each read of a protobuf bytes field copies it.
            sent = req.openai.body if body is None else b""
            keys, key = await off_loop(body.nbytes if body is not None else len(sent), self.fleet.route_keys,
                                       [m.identifier for m in media], body, sent)
        base_id = req.request_id
        try:
            why = self.fleet.lm_wait_reason()
            if why is not None:  # fail before any encode: no LM could take the request
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, why)
            for attempt in range(1, self.cfg.max_attempts + 1):
                if attempt > 1:  # a fresh id: the engines may still be dropping the failed one
                    req.request_id = f"{base_id}-retry{attempt - 1}"
                sent = False
                try:
                    async with contextlib.aclosing(self._attempt(req, media, timings, deadline, excluded,
                                                                 body, ticket, lm, disaggregate, keys,
                                                                 key)) as gen:
                        async for resp in gen:
                            sent = True
                            yield resp
                    return
                except Failure as f:
                    last = attempt == self.cfg.max_attempts or time.monotonic() >= deadline
                    if sent or not f.retryable or last:
                        if f.reverify:  # verified again even when this request cannot be retried
                            self.fleet.recheck(f)
                        raise f.error from None
                    excluded[f.role].update(i.address for i in f.blame)
                    timings.retries += 1
                    RETRIES.labels(f.role, f.error.code().name).inc()
                    logger.warning("request %s: attempt %d failed at %s %s (%s: %s); retrying elsewhere",
                                   base_id, attempt, f.role, ",".join(i.address for i in f.blame),
                                   f.error.code().name, f.error.details())
                    self.fleet.recheck(f)
        finally:
            req.request_id = base_id  # callers log and answer with the id the client knows
            timings.total_ms = timings.since_start_ms()

    def _pick(self, excluded: dict[str, set[str]], pinned: str | None,
              disaggregate: bool, items: list[str], keys: Prefix, key: str) -> tuple[Instance, Instance | None]:
        """The attempt's LM, and its decode LM for E -> P -> D. Raises Failure when there is none."""
        if pinned is not None:
            lm = self.fleet.pinned_lm(pinned, excluded["lm"])
            if lm is None:
                raise Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, f"the LM that holds this request's state "
                                                                     f"({pinned}) is not available"),
                              "lm", [], retryable=False)
            return lm, None
        lm, decode = self.fleet.pick_lms(excluded["lm"], disaggregate, items, keys, key)
        if lm is None:
            why = self.fleet.lm_wait_reason() or "no healthy LM instance"
            raise Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, why), "lm", [], retryable=False)
        return lm, decode

    async def _place(self, excluded: dict[str, set[str]], pinned: str | None, disaggregate: bool,
                     items: list[str], keys: Prefix, key: str) -> tuple[Instance, Instance | None, Lease | None]:
        """``_pick``, and a place on the LM picked (``lm_places``): an LM full for the front door is passed over
        for the policy's next pick among the healthy LMs; when every one is full, or the request is pinned to
        its LM, the policy's own pick takes its place anyway (never refused once admitted). Returns the LM, its
        decode LM for E -> P -> D, and the place the caller gives back when the attempt ends."""
        if not self.places.enabled:
            return *self._pick(excluded, pinned, disaggregate, items, keys, key), None
        full: set[str] = set()
        while pinned is None:
            try:
                lm, decode = self._pick({**excluded, "lm": excluded["lm"] | full}, pinned, disaggregate, items,
                                        keys, key)
            except Failure:
                if not full:
                    raise
                break  # every LM is full
            if full and lm.address not in {i.address for i in self.fleet.lms.healthy(excluded["lm"])}:
                break  # past the healthy LMs (the fleet's fallback to ejected ones): every healthy one is full
            place = await self.places.take(lm)
            if place is not None:
                return lm, decode, place
            full.add(lm.address)
        lm, decode = self._pick(excluded, pinned, disaggregate, items, keys, key)
        return lm, decode, await self.places.take(lm, force=True)

    async def _encode(self, req, media, timings: Timings, deadline: float, excluded: dict[str, set[str]],
                      ticket: Ticket | None, readers: int, groups: list[EncodeGroup]) -> None:
        """Starts the attempt's encodes into ``groups`` (the caller's, so its cleanup sees them even when
        this is cancelled) and returns once every item has its source; none when the LM encodes the
        images itself (``timings.placement`` says which, and why)."""
        timings.placement, timings.placement_reason = self.fleet.placement(excluded)
        if timings.placement == "encoder":
            groups.extend(self.encodes.plan(media, excluded["encoder"], req.request_id))
            if groups:
                await self.encodes.start(req, media, groups, timings, deadline, readers=readers)
            else:
                timings.placement, timings.placement_reason = "local", "no healthy encoder"
        PLACEMENT.labels(timings.placement, timings.placement_reason).inc()
        if timings.placement == "local" and ticket is not None:
            ticket.drop_encoder()

    async def _attempt(self, req, media, timings: Timings, deadline: float, excluded: dict[str, set[str]],
                       body: LMBody | None = None, ticket: Ticket | None = None, pinned: str | None = None,
                       disaggregate: bool = True, keys: Prefix = NONE, key: str = ""):
        _fresh_attempt(req, media, timings)
        handed: dict[str, bytes] = {}  # the prefill LM's params until the decode LM answers
        decode: Instance | None = None
        groups: list[EncodeGroup] = []
        answered, place = False, None  # place: the one held on the LM that runs the attempt (``lm_places``)
        # Queued until the first attempt dispatches (planning below does no I/O but the place's).
        timings.queue_ms = timings.queue_ms or timings.since_start_ms()
        try:
            lm, decode, place = await self._place(excluded, pinned, disaggregate, [m.identifier for m in media],
                                                  keys, key)
            req.prefix_key = keys.last
            if media:
                # E -> P -> D: the decode LM may need an item too (its recompute of the prompt's last
                # token falls inside it): a second claim on each copy, the decode LM's.
                await self._encode(req, media, timings, deadline, excluded, ticket,
                                   readers=2 if decode is not None else 1, groups=groups)
                if ticket is not None:  # a speech upload's windows, cut by now: its tenant's media quota
                    ticket.count_items(len(req.items))
            timings.lm = lm.address
            if body is not None:  # the request's own media (an API that encodes none has some too)
                req.openai.body = body.render(req, home=(decode or lm).address)  # the LM that answers, and stores
            prefill = None
            if decode is not None:
                params = await handoff.prefill(lm, req, groups, timings, deadline, handed)
                if isinstance(params, list):  # the prefill LM refused the request: its answer is the answer
                    # Not `answered`: no LM will read the encodes' copies, so they are cancelled (the encoder
                    # frees them) rather than left to their leases.
                    for resp in params:
                        yield resp
                    return
                prefill, lm, req = lm, decode, handoff.decode_request(req, params)
                place = await self.places.move(place, lm)  # the decode LM's place for the prefill LM's
                timings.prefill_lm, timings.lm = timings.lm, lm.address
            # aclosing: a caller that stops early (client gone) cancels the LM call now,
            # not whenever the garbage collector finalizes the generator.
            async with contextlib.aclosing(call_lm(lm, req, groups, timings, deadline, prefill=prefill)) as answer:
                try:
                    async for resp in answer:
                        handed.clear()  # the decode LM answered: the blocks are its to settle
                        yield resp
                except Failure as f:
                    if f.reverify and decode is not None:
                        # The decode LM is one no longer (it refuses RELEASE too): another one sends it.
                        decode = next((i for i in self.fleet.lms.healthy({decode.address})
                                       if i.lm_role == "decode"), None)
                    raise
            answered = True
            for holder in (prefill, lm):  # their prefix caches now hold the prompt, images included
                if holder is not None:
                    self.fleet.answered(holder, [m.identifier for m in media], keys.last)
        finally:
            self.places.give_back(place)
            if handed and decode is not None:
                # Handed over and never answered by the decode LM (the client went away between the calls,
                # the call failed before reaching it): the prefill LM would pin the blocks to its lease.
                self.releases.release(decode, req.request_id, handed["params"])
            self.encodes.settle(groups, answered)


def _fresh_attempt(req, media, timings: Timings) -> None:
    """Clears what an earlier attempt left on ``req`` and ``timings``: the speech windows past the upload's
    own item, each item's source, the P/D hand-off, and the attempt's own timings."""
    if len(req.items) > len(media):
        del req.items[len(media):]
    for item in req.items:
        item.ClearField("source")
    handoff.clear(req)
    timings.encoders, timings.prefill_lm, timings.prefill_ms = [], "", 0.0
