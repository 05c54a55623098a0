"""OpenAI REST (and the request half of the native gRPC API): the gateway reads
only what disaggregation needs from a request, its media, and passes the body
on to an LM, whose vLLM serving classes validate and answer it exactly as
``vllm serve`` does; their bytes come back unchanged (with ``--epd-facts``,
non-streaming responses get an ``epd`` object added, streams an ``: epd`` SSE
comment before ``[DONE]``). Also the one function that maps gRPC status codes
to OpenAI-style HTTP errors."""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.common.media import content_id, sniff_audio_format, sniff_video_format
from services.gateway import metrics
from services.gateway.admission import AdmissionRefused
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher, load_images
from services.gateway.intake import CURRENT_LEASE, BodyRefused, Intake, charge_fetched
from services.gateway.orchestrator import Media, Orchestrator, Timings
from services.gateway.parts import LM_PART, MediaPart, PartError, anthropic_media_parts, media_parts

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = "epd_request_id"
ARRIVAL_KEY = "epd_arrival"
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (502, "server_error"),
    # The gateway's own credentials or an LM's allow-list: a deployment fault, not the client's.
    grpc.StatusCode.UNAUTHENTICATED: (502, "server_error"),
    grpc.StatusCode.PERMISSION_DENIED: (502, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


_DEPLOYMENT_FAULTS = {
    grpc.StatusCode.INTERNAL: "internal error",
    grpc.StatusCode.UNAVAILABLE: "no instance could serve the request",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out in the deployment",
    grpc.StatusCode.FAILED_PRECONDITION: "the deployment's instances do not agree",
    grpc.StatusCode.UNAUTHENTICATED: "the deployment's instances refused each other's credentials",
    grpc.StatusCode.PERMISSION_DENIED: "the deployment's instances refused each other's credentials",
}
"""Codes whose details describe the deployment (instance addresses, what failed where), not the request:
without ``--epd-facts`` a caller gets this summary and the request id; the gateway's log has the details."""


def from_grpc(e: grpc.aio.AioRpcError, rid: str = "", facts: bool = True) -> ApiError:
    """The one place gRPC codes become HTTP errors. ``facts`` off (``--epd-facts``): a deployment
    fault's details are replaced by a summary naming the request (``rid``)."""
    status, type_ = _HTTP_STATUS.get(e.code(), (500, "server_error"))
    summary = _DEPLOYMENT_FAULTS.get(e.code())
    if summary is not None and not facts:
        return ApiError(status, f"{summary} (request {rid or 'unknown'}; the gateway's log has the details)", type_)
    return ApiError(status, e.details() or e.code().name, type_)


def error_body(e: ApiError, anthropic: bool = False) -> dict[str, Any]:
    """An error as vLLM's server writes it: OpenAI's shape, or Anthropic's for the Messages API
    (vLLM's ``translate_error_response``: the type and message only)."""
    if anthropic:
        return {"type": "error", "error": {"type": e.type, "message": e.message}}
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}


def error_response(e: ApiError, headers: dict[str, str] | None = None, anthropic: bool = False) -> web.Response:
    return web.json_response(error_body(e, anthropic), status=e.status, headers=headers)


def loads_strict(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259): unlike ``json.loads`` it refuses the NaN, Infinity and
    -Infinity literals. Raises ApiError (400)."""
    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def engine_request_id(client_id: str, prefix: str) -> str:
    """The id the encoders and the LM see for one request: the client's ``X-Request-Id`` with a random
    suffix (clients may send the same id twice; an engine needs unique ones, and the client's id still
    finds the request in every service's logs), or ``<prefix>-<uuid>`` without one."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


def media_api_error(e: MediaError) -> ApiError:
    """A refused media item as the REST API answers it: 400 or 413, param image_url (audio_url)."""
    return ApiError(e.status, str(e), param=f"{e.modality}_url")


MIME = {"WAV": "audio/wav", "FLAC": "audio/flac", "OGG": "audio/ogg", "MP3": "audio/mpeg",
        "MP4": "video/mp4", "WEBM": "video/webm", "AVI": "video/x-msvideo"}
LIMIT_FLAG = {"image": "max_images", "audio": "max_audios", "video": "max_videos"}
ITEMS = {"image": "images", "audio": "audio clips", "video": "videos"}
MEDIA_REF = "epd-media:"  # gRPC API: an image_url/audio_url that names OpenAIRequest.media[N]


@dataclass(frozen=True)
class Api:
    """One endpoint of ``vllm serve`` the gateway answers. Chat and completions go to the LM's serving
    classes by name; every other one to the LM's copy of vLLM's own app (``services.lm.vllm_app``) by
    method and path. ``media``: where its media are (``messages``: chat parts; ``input``: the
    Responses API's input items; ``anthropic``: Messages image blocks; empty: none). ``encode``: its
    items go through encoders (tokenize and count_tokens only lay prompts out: the LM's processor
    expands the placeholders, no vision run). ``done``: its stream ends with ``data: [DONE]``."""

    name: str
    method: str
    path: str
    prefix: str
    media: str = ""
    encode: bool = True
    done: bool = False
    anthropic: bool = False

    @property
    def lm_api(self) -> str:
        return self.name if self.name in ("chat", "completions") else "http"


APIS: tuple[Api, ...] = (
    Api("chat", "POST", "/v1/chat/completions", "chatcmpl", "messages", done=True),
    Api("completions", "POST", "/v1/completions", "cmpl", done=True),
    Api("responses", "POST", "/v1/responses", "resp", "input"),
    Api("responses_get", "GET", "/v1/responses/{response_id}", "resp"),
    Api("responses_cancel", "POST", "/v1/responses/{response_id}/cancel", "resp"),
    Api("messages", "POST", "/v1/messages", "msg", "anthropic", anthropic=True),
    Api("count_tokens", "POST", "/v1/messages/count_tokens", "msg", "anthropic", encode=False, anthropic=True),
    Api("tokenize", "POST", "/tokenize", "tok", "messages", encode=False),
    Api("detokenize", "POST", "/detokenize", "tok"),
    Api("version", "GET", "/version", "req"),
)
API = {a.name: a for a in APIS}


@dataclass
class OpenAICall:
    """One OpenAI request on its way through the gateway: the client's body (never changed; each LM
    attempt gets a copy from ``lm_body``), where its image parts are, and the images' sources."""

    api: str  # a name in APIS
    body: dict[str, Any]
    stream: bool
    parts: list[MediaPart] = field(default_factory=list)  # where each media item is, in order
    sources: list[str | bytes] = field(default_factory=list)  # the items' URLs (or gRPC media bytes)
    modalities: list[str] = field(default_factory=list)  # each item's: "image", "audio" or "video"
    request_id: str = ""
    """The request's id in the LM's body: vLLM names its response ``chatcmpl-<id>`` / ``cmpl-<id>``
    from it. As with ``vllm serve``, the client's X-Request-Id wins (``id_given``); else the body's
    own ``request_id``; else this one, made by the gateway."""
    id_given: bool = False

    def drop_payload(self) -> None:
        """Frees the request's body and media sources once it is answered, whatever still refers to
        this object (a retry closure, a task in a reference cycle)."""
        self.body = {}
        self.sources.clear()

    def lm_body(self, req: lm_pb2.GenerateRequest, media: list[Media]) -> bytes:
        """The body for one LM attempt: each item an encoder laid out becomes a uuid-only part (the
        LM never sees its bytes); any other item a data: URL of the bytes the gateway read (the LM
        never downloads), with its content hash as uuid when an encoder has its embedding. Audio goes
        as vLLM's ``audio_url`` part (an ``input_audio`` part too)."""
        body = copy.deepcopy(self.body) if self.parts else dict(self.body)
        spec = API[self.api]
        if self.request_id and spec.lm_api != "http" and (self.id_given or not body.get("request_id")):
            body["request_id"] = self.request_id
        items = list(req.items) if spec.encode else [None] * len(media)
        # The LM lays a prompt out from the encoders' layouts only when every item has one; else its
        # processor lays the whole prompt out and needs every item's bytes.
        laid_out = spec.encode and all(item.source.placeholder_token_ids for item in req.items)
        for p, item, m in zip(self.parts, items, media):
            data_url = None if laid_out else _data_url(m)
            ident = item.identifier if item is not None and (laid_out or item.HasField("source")) else None
            if spec.media == "anthropic":
                # vLLM's converter drops any uuid: the LM knows an encoder's image by its content hash.
                block = body["messages"][p.message]["content"][p.part]
                if p.inner >= 0:
                    block = block["content"][p.inner]
                block["source"] = {"type": "base64", "media_type": "image/png",
                                   "data": base64.b64encode(m.data).decode()}
                continue
            if spec.media == "input" and m.modality == "image":
                part: dict[str, Any] = {"type": "input_image", "image_url": data_url}
            else:
                kind = LM_PART[m.modality]
                part = {"type": kind, kind: None if data_url is None else {"url": data_url}}
            if ident is not None:
                part["uuid"] = ident  # else the LM encodes it itself and hashes it as vLLM does
            body[p.container][p.message]["content"][p.part] = part
        return json.dumps(body, ensure_ascii=False).encode()


def _data_url(m: Media) -> str:
    if m.modality == "image":
        mime = "image/png"  # the LM's image decoder sniffs the format
    else:
        sniffed = sniff_audio_format(m.data) if m.modality == "audio" else sniff_video_format(m.data)
        mime = MIME.get(sniffed or "", f"{m.modality}/octet-stream")
    return f"data:{mime};base64," + base64.b64encode(m.data).decode()


def parse_openai(api: str, raw: bytes, cfg: GatewayConfig, media: list[bytes] | None = None) -> OpenAICall:
    """Reads what the gateway needs from a request body, without I/O: whether it streams, and where its
    media are, found by vLLM's own rule (``services.gateway.parts``). Everything else is vLLM's to
    validate (on the LM). ``media``: the gRPC API's raw media, named by ``epd-media:N`` URLs. Raises
    ApiError."""
    spec = API[api]
    body = loads_strict(raw) if raw or spec.method != "GET" else {}
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    call = OpenAICall(api, body, body.get("stream") is True)
    try:
        if spec.media == "anthropic":
            found = anthropic_media_parts(body.get("messages"))
        elif spec.media:
            found = media_parts(body.get(spec.media), spec.media)
        else:
            found = []
    except PartError as e:
        raise ApiError(400, str(e), param=spec.media) from None
    for p in found:
        limit = getattr(cfg, LIMIT_FLAG[p.modality])
        if call.modalities.count(p.modality) >= limit:
            raise ApiError(400, f"at most {limit} {ITEMS[p.modality]} per request (--max-{p.modality}s)",
                           param=spec.media)
        call.modalities.append(p.modality)
        if p.source.startswith(MEDIA_REF):
            k = p.source[len(MEDIA_REF):]
            if media is None or not k.isdigit() or int(k) >= len(media):
                raise ApiError(400, f"{p.where}: {p.source!r} names no media item", param=spec.media)
            call.sources.append(media[int(k)])
        else:
            call.sources.append(p.source)
        call.parts.append(p)
    return call


async def load_media(call: OpenAICall, req: lm_pb2.GenerateRequest, cfg: GatewayConfig,
                     fetcher: MediaFetcher | None) -> list[Media]:
    """Loads every media item of ``call`` (data: decoded, http(s) fetched concurrently, every header
    checked), adds one item per image or audio clip to ``req`` in order and returns them as Media.
    Raises MediaError."""
    try:
        datas = await load_images(call.sources, cfg, fetcher, call.modalities)
    except MediaError as e:
        logger.info("request %s: media refused (%d): %s", req.request_id, e.status, e)
        raise
    # Fetched media are held as long as the request; its body's share of the budget does not cover them.
    await charge_fetched(sum(len(d) for d, src in zip(datas, call.sources)
                             if isinstance(src, str) and not src.startswith("data:")))
    media = []
    for data, modality in zip(datas, call.modalities):
        ident = content_id(data)
        if API[call.api].encode:  # else the LM lays the prompt out itself, from the bytes in its body
            req.items.add(modality=modality, identifier=ident)
        media.append(Media(data, ident, modality))
    return media


def epd_facts(timings: Timings, last: lm_pb2.GenerateResponse | None) -> dict[str, Any]:
    """What the gateway adds to a response as ``epd``."""
    return {"timings": timings.as_dict(),
            "local_encoder_runs": last.local_encoder_runs if last else 0,
            "transferred_items": last.transferred_items if last else 0,
            "transports": timings.transports, "encoders": timings.encoders, "lm": timings.lm,
            "retries": timings.retries, "placement": timings.placement,
            "placement_reason": timings.placement_reason}


class OpenAIRoutes:
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None,
                 intake: Intake | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused. ``intake``: the body limits before admission (default: this config's own). The served
        model is ``orch.model``: unknown (every request 503) until an LM is admitted."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher
        self.intake = intake or Intake(cfg)

    @property
    def model(self) -> str:
        return self.orch.model or ""

    def _check_ready(self) -> None:
        """503, saying what the gateway waits for, until an LM has been admitted."""
        why = self.orch.lm_wait_reason()
        if why is not None:
            raise ApiError(503, why, "server_error")

    def add_to(self, app: web.Application) -> None:
        for spec in APIS:
            app.router.add_route(spec.method, spec.path, functools.partial(self._serve, api=spec.name))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/ping", self.ping)
        app.router.add_post("/ping", self.ping)
        app.router.add_get("/health", self.health)

    async def models(self, request: web.Request) -> web.Response:
        """The served model; 503 (as every request, so clients retry) while it is not known yet."""
        if self.orch.model is None:
            return error_response(ApiError(503, self.orch.lm_wait_reason() or "no LM is ready yet", "server_error"))
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "epd-serve"}]})

    async def ping(self, request: web.Request) -> web.Response:
        """As ``vllm serve``'s /ping (and its /health): 200 with no body while serving (here: an LM
        is admitted), else 503."""
        return web.Response(status=200 if any(self.orch.health().get("lms", {}).values()) else 503)

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one LM is admitted (a readiness probe), else 503. With
        ``--epd-facts`` the body also says why, lists every instance (admitted or not)
        and why each one that is out is out; without, only the status and model."""
        instances = self.orch.health()
        ok = any(instances.get("lms", {}).values())
        if not self.cfg.epd_facts:
            return web.json_response({"status": "ok" if ok else "unavailable", "model": self.orch.model},
                                     status=200 if ok else 503)
        status = "ok" if ok else self.orch.lm_wait_reason() or "no healthy LM"
        return web.json_response({"status": status, "model": self.orch.model, **instances,
                                  "out": self.orch.not_admitted()}, status=200 if ok else 503)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api="chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api="completions")

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        """Every API's request: read (intake, the API's media reader), admitted, its media loaded and
        hashed, encoded and answered by an LM (the orchestrator), relayed (``_respond``)."""
        spec = API[api]
        given = request.get(REQUEST_ID_KEY)
        rid = given or uuid.uuid4().hex
        request[REQUEST_ID_KEY] = rid
        req = lm_pb2.GenerateRequest(request_id=engine_request_id(rid, spec.prefix))
        req.openai.api = spec.lm_api
        if spec.lm_api == "http":
            req.openai.method, req.openai.path = spec.method, request.path
        headers = {REQUEST_ID_HEADER: rid}
        ticket = lease = None
        try:
            raw, lease = await self.intake.read(request)
            CURRENT_LEASE.set(lease)
            call = parse_openai(api, raw, self.cfg)
            del raw  # parsed: the text goes
            call.request_id, call.id_given = rid, bool(given)
            self._check_ready()
            # Admission before any image is fetched: past capacity the request waits its turn or is
            # refused now (429/503 with Retry-After), never half-way through.
            ticket = await self.orch.admission.admit(self.orch.encodes_remotely(len(call.parts) if spec.encode else 0))
            media = await load_media(call, req, self.cfg, self.fetcher)
        except (ApiError, MediaError, AdmissionRefused, BodyRefused) as e:
            if ticket is not None:
                ticket.release()
            if lease is not None:
                lease.release()
            if isinstance(e, AdmissionRefused):
                headers["Retry-After"] = str(e.retry_after_s)
                err = ApiError(e.status, e.message, "rate_limit_error" if e.status == 429 else "server_error")
            elif isinstance(e, BodyRefused):
                if e.status == 503:
                    headers["Retry-After"] = "1"
                err = ApiError(e.status, e.message, "server_error" if e.status == 503 else "invalid_request_error")
            else:
                err = e if isinstance(e, ApiError) else media_api_error(e)
            metrics.REQUESTS.labels(api, str(err.status)).inc()
            return error_response(err, headers, spec.anthropic)
        except BaseException:  # the client went away during a fetch, or a bug: the place goes back
            if ticket is not None:
                ticket.release()
            if lease is not None:
                lease.release()
            raise
        timings = Timings(start=request.get(ARRIVAL_KEY) or time.perf_counter())
        gen = self.orch.generate(req, media if spec.encode else [], timings, ticket=ticket,
                                 prepare=lambda r: setattr(r.openai, "body", call.lm_body(r, media)))
        try:
            return await self._respond(request, req, call, len(media), gen, timings)
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("request %s: the client went away after %.0f ms; cancelling its LM call",
                        req.request_id, timings.since_start_ms())
            raise
        finally:
            # A client that went away (or any error) must cancel the LM call now,
            # which aborts the engine request and frees what it holds.
            await gen.aclose()
            ticket.release()
            lease.release()
            call.drop_payload()
            media.clear()
            req.ClearField("openai")

    async def _respond(self, request, req, call: OpenAICall, n_media: int, gen, timings) -> web.StreamResponse:
        route = call.api
        spec = API[route]
        # The client's id (X-Request-Id) answers and logs; the engines saw it made unique (req.request_id).
        rid = request.get(REQUEST_ID_KEY) or req.request_id
        headers = {REQUEST_ID_HEADER: rid}
        try:
            first = await anext(gen, None)
        except grpc.aio.AioRpcError as e:
            err = from_grpc(e, rid, self.cfg.epd_facts)
            finished(route, err.status, rid, timings, n_media, e.details() or "", engine_id=req.request_id)
            return error_response(err, headers, spec.anthropic)
        if first is None or first.http_status != 200:
            status = first.http_status if first is not None else 502
            payload = first.openai if first is not None else json.dumps(
                error_body(ApiError(502, "the LM sent no answer", "server_error"), spec.anthropic)).encode()
            finished(route, status, rid, timings, n_media, payload[:200].decode(errors="replace"),
                     engine_id=req.request_id)
            return web.Response(body=payload, status=status, headers={
                **headers, "Content-Type": (first.content_type if first is not None else "") or "application/json"})
        streaming = first.content_type.startswith("text/event-stream") if first.content_type else call.stream
        if not streaming:
            last = None
            try:
                async for resp in gen:
                    last = resp
            except grpc.aio.AioRpcError as e:
                err = from_grpc(e, rid, self.cfg.epd_facts)
                finished(route, err.status, rid, timings, n_media, e.details() or "", engine_id=req.request_id)
                return error_response(err, headers, spec.anthropic)
            finished(route, 200, rid, timings, n_media, engine_id=req.request_id)
            content_type = first.content_type or "application/json"
            if self.cfg.epd_facts and content_type.startswith("application/json"):
                out = json.loads(first.openai)
                if isinstance(out, dict):
                    out["epd"] = epd_facts(timings, last)
                    return web.json_response(out, headers=headers, dumps=lambda o: json.dumps(o, ensure_ascii=False))
            return web.Response(body=first.openai, status=200, headers={**headers, "Content-Type": content_type})
        response = web.StreamResponse(headers={"Content-Type": first.content_type or "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        done, last = b"", None
        try:
            resp = first
            async for resp in _chain(first, gen):
                if resp.openai.startswith(b"data: [DONE]"):
                    done = resp.openai  # after the epd comment
                elif resp.openai:
                    await response.write(resp.openai)
                else:
                    last = resp
            finished(route, 200, rid, timings, n_media, engine_id=req.request_id)
        except grpc.aio.AioRpcError as e:
            # Past the first event there is no retry: the stream ends with an error event.
            err = from_grpc(e, rid, self.cfg.epd_facts)
            finished(route, err.status, rid, timings, n_media, e.details() or "", engine_id=req.request_id)
            event = b"event: error\n" if spec.anthropic else b""
            await response.write(event + b"data: " + json.dumps(error_body(err, spec.anthropic)).encode() + b"\n\n")
        if self.cfg.epd_facts:
            await response.write(b": epd " + json.dumps(epd_facts(timings, last)).encode() + b"\n\n")
        if spec.done:
            await response.write(done or b"data: [DONE]\n\n")
        elif done:
            await response.write(done)
        await response.write_eof()
        return response


async def _chain(first, rest):
    yield first
    async for x in rest:
        yield x


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


@web.middleware
async def request_context(request: web.Request, handler):
    """Stamps each request's arrival (the gateway queue stage starts here) and
    its id: a client's ``X-Request-Id`` (letters, digits, ``._-``, up to 64) is
    echoed, logged, and carried through the encoder and LM with a unique suffix
    (``engine_request_id``); otherwise the gateway makes one."""
    request[ARRIVAL_KEY] = time.perf_counter()
    rid = request.headers.get(REQUEST_ID_HEADER, "")
    if rid:
        if not REQUEST_ID_RE.fullmatch(rid):
            return error_response(ApiError(400, f"{REQUEST_ID_HEADER} must match {REQUEST_ID_RE.pattern}"))
        request[REQUEST_ID_KEY] = rid
    return await handler(request)
