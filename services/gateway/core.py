"""The gateway's one request core, for every API and both transports (REST: ``openai_api``; the
native gRPC API: ``servicer``).

``RequestCore.admit`` takes a request body for one ``Api`` (``request.APIS``) and does everything
before an LM is called: parse (the API's media reader, vLLM's rule), check an LM is ready, admission,
load and hash the media. It answers an ``Admitted`` request, or raises ``ApiError`` (an HTTP status,
message and error type, and ``Retry-After`` where a client should come back). ``Admitted.generate``
runs it (encode -> LM, failover: ``orchestrator``) and yields the LM's messages; the transports only
relay them. ``Admitted.close`` releases what the request holds; its owner (the transport's handler)
calls it once, in a ``finally``.

A request about a stored response (``GET``/cancel, ``previous_response_id``) is pinned to the LM its id
names, for its owner only; the core keeps no Responses state of its own (``responses``: the id carries it).

The error mapping between HTTP statuses and gRPC codes is ``errors``', once, both ways (``STATUS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.common.routes import API, Api
from services.gateway import metrics
from services.gateway.admission import AdmissionRefused
from services.gateway.background import BackgroundWork
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.fetch import MediaFetcher
from services.gateway.lm_body import LMBody
from services.gateway.orchestrator import Orchestrator
from services.gateway.parse_pool import ParsePool
from services.gateway.request import OpenAICall, engine_request_id, load_media, parse_openai
from services.gateway.responses import ResponseIds, named_response, response_id
from services.gateway.state import SharedState
from services.gateway.tenants import ANONYMOUS, Tenant
from services.gateway.values import Media, Timings

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""A client's request id (REST's header, the gRPC API's field or metadata)."""


@dataclass
class Admitted:
    """A request past admission with its media loaded: what ``generate`` runs, and what ``close``
    releases (the admission ticket, the body's share of the intake budget, the body and media)."""

    api: Api
    call: OpenAICall
    req: lm_pb2.GenerateRequest
    media: list[Media]
    timings: Timings
    ticket: Any
    lease: Any = None
    tenant: str = ANONYMOUS
    """Whose request this is (``services.gateway.tenants``: the name its API key resolved to)."""
    pinned: str | None = None
    """The LM that must answer (it holds the stored response the request names)."""
    background: bool = False
    """A background Responses request: once its LM accepted it, ``close`` hands its place to ``_work``."""
    _orch: Orchestrator | None = field(default=None, repr=False)
    _ids: ResponseIds | None = field(default=None, repr=False)  # mints a Responses answer's id per LM attempt
    _work: BackgroundWork | None = field(default=None, repr=False)
    _accepted: tuple[str, str] | None = field(default=None, repr=False)  # (response id, LM) of a background one
    _place: Any = field(default=None, repr=False)  # a background request's reserved place (BackgroundPlace)

    async def generate(self):
        """The LM's messages for this request (``Orchestrator.generate``): encodes (for an API that
        encodes), then the LM call, with failover before the first token. A Responses answer's id
        names its LM and tenant itself (``responses``): nothing is recorded, but for a background
        answer, whose place ``close`` hands over."""
        call, media = self.call, self.media
        first = True
        async with contextlib.aclosing(self._orch.generate(
                self.req, media if self.api.encode or self.api.upload else [], self.timings, ticket=self.ticket, lm=self.pinned,
                disaggregate=self.api.generates and call.one_engine_call(), body=self._lm_body())) as answer:
            async for resp in answer:
                if first and self.background and resp.http_status == 200:
                    rid = response_id(resp)
                    if rid and self.timings.lm:
                        self._accepted = (rid, self.timings.lm)
                first = False
                yield resp

    def _lm_body(self) -> LMBody:
        """What each LM attempt's body is rendered from: the call's, with the id minter and the owner of
        a response the LM stores."""
        return dataclasses.replace(self.call.for_lm(self.media), response_ids=self._ids, owner=self.tenant)

    def close(self) -> None:
        if self._accepted is not None and self._work is not None:
            self._work.hold(*self._accepted, self.ticket, self._place)  # the LM works on: the place stays taken
        else:
            self.ticket.release()
        if self._place is not None:
            self._place.release()  # held by the watcher now, or never needed
        if self.lease is not None:
            self.lease.release()
        self.call.drop_payload()
        self.media.clear()
        self.req.ClearField("openai")


class RequestCore:
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, fetcher: MediaFetcher | None = None,
                 quota=Tenant, response_ids: ResponseIds | None = None, state: SharedState | None = None,
                 parser: ParsePool | None = None) -> None:
        """``fetcher``: owned by ``server.serve``; without one http(s) media URLs are refused. ``parser``: the
        helper that parses large bodies off the loop (``parse_pool``; owned by ``server.serve``), else every
        body is parsed on the loop. ``quota``: a
        tenant's quotas (``Tenants.quota``; by default none), for its background work and its weight in an
        LM's response store. ``response_ids``: the Responses ids' minter (default: from ``cfg``'s secret;
        ValueError for one that will not do). ``state``: where background places are counted, the
        orchestrator's admission's (default: this process alone, in memory)."""
        self.cfg, self.orch, self.fetcher, self.quota, self.parser = cfg, orch, fetcher, quota, parser
        self.responses = response_ids or ResponseIds.from_config(cfg)
        self.background = BackgroundWork(lambda: orch.lms, cfg.lm_max_background, cfg.background_timeout_s,
                                         lambda: orch.generating_lms(), quota, state=state)

    async def close(self) -> None:
        """Gives back the places background requests hold (their LMs go on with the work)."""
        await self.background.close()

    def _home(self, named: str | None, tenant: str) -> str | None:
        """The LM a request about the stored response ``named`` goes to (None: it names none): the one its
        id names, for its owner only. Raises ApiError 404 for another tenant's id, one this deployment did
        not mint, or one whose LM is gone, as vLLM answers an id it has not stored, before any LM sees it."""
        if named is None:
            return None
        home = self.responses.home(named, tenant, list(self.orch.lms.instances))
        if home is None:
            raise ApiError(404, f"Response with id '{named}' not found.", param="response_id")
        return home

    async def _parse(self, api: str, raw: bytes, media: list[bytes] | None, content_type: str) -> OpenAICall:
        """``parse_openai``'s call: a large body's decided in the parse helper (the same call, or the same
        ApiError; 503 if the helper died holding it), a small one's here, on the loop."""
        if self.parser is not None and self.parser.wants(api, raw):
            return await self.parser.parse(api, raw, media, content_type)
        return parse_openai(api, raw, self.cfg, media, content_type)

    async def admit(self, api: str, raw: bytes, *, client_id: str, id_given: bool, path: str = "",
                    media: list[bytes] | None = None, lease=None, arrival: float | None = None,
                    content_type: str = "", tenant: str = ANONYMOUS) -> Admitted:
        """``raw``: the body (``media``: the gRPC API's raw media, named by ``epd-media:N``;
        ``content_type``: the body's, for an upload API);
        ``client_id``: the request's id (the client's when ``id_given``); ``path``: the route's path
        as requested (a Responses id in it). ``lease``: the body's share of the intake budget, given
        back by ``Admitted.close`` (or here, on a refusal). ``tenant``: the client's tenant, as its
        transport authenticated it (``Admitted.tenant``). Raises ApiError."""
        spec = API[api]
        ticket = place = None
        try:
            call = await self._parse(api, raw, media, content_type)
            del raw  # parsed: the text goes
            call.request_id, call.id_given = client_id, id_given
            if tenant != ANONYMOUS:
                call.salt_tenant = tenant  # each tenant its own prefix-cache namespace
            pinned = self._home(named_response(api, call.body, path), tenant)
            why = self.orch.lm_wait_reason()
            if why is not None:  # before any media is loaded: nothing could take the request
                raise ApiError(503, why, "server_error")
            req = lm_pb2.GenerateRequest(request_id=engine_request_id(client_id, spec.prefix),
                                         tenant_weight=self.quota(tenant).share)  # its share of the LM's response store
            req.openai.api = spec.lm_api
            if spec.lm_api == "http":
                req.openai.method, req.openai.path = spec.method, path or spec.path
                req.openai.content_type = call.content_type
            # Admission before any media is fetched: past capacity the request waits its turn or is
            # refused now (429/503 with Retry-After), never half-way through.
            background = api == "responses" and bool(call.body.get("background"))
            try:
                if background:
                    place = await self.background.take_place(tenant)
                ticket = await self.orch.admission.admit(
                    self.orch.encodes_remotely(len(call.parts) if spec.encode else int(spec.upload)), tenant,
                    items=len(call.modalities) + int(spec.upload))  # its images_per_minute: media, an upload one
            except AdmissionRefused as e:
                raise ApiError(e.status, e.message, "rate_limit_error" if e.status == 429 else "server_error",
                               retry_after=str(e.retry_after_s)) from None
            try:
                loaded = await load_media(call, req, self.cfg, self.fetcher, lease)
            except MediaError as e:
                raise ApiError(e.status, str(e), param=f"{e.modality}_url") from None
        except BaseException:  # refused, the client went away during a fetch, or a bug: the places go back
            if ticket is not None:
                ticket.release()
            if place is not None:
                place.release()
            if lease is not None:
                lease.release()
            raise
        return Admitted(spec, call, req, loaded, Timings(start=arrival or time.perf_counter()), ticket, lease,
                        tenant=tenant, pinned=pinned, background=background, _orch=self.orch,
                        _ids=self.responses, _work=self.background, _place=place)


def epd_facts(timings: Timings, last: lm_pb2.GenerateResponse | None) -> dict[str, Any]:
    """What the gateway adds to a response as ``epd``."""
    return {"timings": timings.as_dict(),
            "local_encoder_runs": last.local_encoder_runs if last else 0,
            "transferred_items": last.transferred_items if last else 0,
            "transports": timings.transports, "encoders": timings.encoders, "lm": timings.lm,
            "retries": timings.retries, "placement": timings.placement,
            "placement_reason": timings.placement_reason,
            **({"prefill_lm": timings.prefill_lm} if timings.prefill_lm else {})}


def finished(route: str, status: int, rid: str, timings: Timings, media: int, error: str = "",
             engine_id: str = "") -> None:
    """Metrics and the one log line per finished request (REST and gRPC). ``rid``: the client's id;
    ``engine_id``: the id the encoders and the LM logged it under, when it differs."""
    metrics.observe(route, status, timings, media)
    name = f"{rid} (engine id {engine_id})" if engine_id and engine_id != rid else rid
    if status == 200:
        logger.info("request %s: 200 in %.1f ms (ttft %.1f ms, %d item(s), encoders %s, lm %s, retries %d)",
                    name, timings.total_ms, timings.ttft_ms, media, ",".join(timings.encoders) or "-",
                    timings.lm or "-", timings.retries)
    else:
        logger.warning("request %s: %d after %.1f ms (lm %s, retries %d): %s",
                       name, status, timings.total_ms, timings.lm or "-", timings.retries, error)


