"""The OpenAI-compatible REST API (and Anthropic's Messages API, and the rest of ``vllm serve``'s
routes): a transport over the request core (``services.gateway.core``). Each route reads its body
through the intake (bounded before admission), hands it to the core, and relays the LM's answer:
vLLM's bytes unchanged (with ``--epd-facts``, a JSON answer gets an ``epd`` object added, a stream an
``: epd`` SSE comment at its end)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import struct
import time
import uuid

import grpc
from aiohttp import web

from services.common.routes import API, APIS
from services.gateway import metrics
from services.gateway.auth import TENANT_KEY
from services.gateway.config import GatewayConfig
from services.gateway.core import REQUEST_ID_HEADER, REQUEST_ID_RE, RequestCore, epd_facts, finished
from services.gateway.errors import ApiError, body_refused, error_body, from_grpc
from services.gateway.fetch import MediaFetcher
from services.gateway.intake import SLOW_READERS, BodyRefused, Intake
from services.gateway.orchestrator import Orchestrator
from services.gateway.request import SCALE_OUT_DISABLED, SCALE_OUT_PATHS, OpenAICall
from services.gateway.tenants import ANONYMOUS

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "epd_request_id"
ARRIVAL_KEY = "epd_arrival"


class SlowReader(ConnectionResetError):
    """The client did not take a part of its answer within ``--answer-timeout-s`` (plus the part's size at
    ``--answer-min-rate-kib``): its connection is closed, and the request ends as if it had gone away."""

def error_response(e: ApiError, headers: dict[str, str] | None = None, anthropic: bool = False) -> web.Response:
    if e.retry_after is not None:
        headers = {**(headers or {}), "Retry-After": e.retry_after}
    return web.json_response(error_body(e, anthropic), status=e.status, headers=headers)


class OpenAIRoutes:
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None,
                 intake: Intake | None = None, core: RequestCore | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused. ``intake``: the body limits before admission (default: this config's own). The served
        model is ``orch.model``: unknown (every request 503) until an LM is admitted."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher
        self.intake = intake or Intake(cfg)
        self.core = core or RequestCore(cfg, orch, fetcher)

    @property
    def model(self) -> str:
        return self.orch.model or ""

    def add_to(self, app: web.Application) -> None:
        for spec in APIS:
            app.router.add_route(spec.method, spec.path, functools.partial(self._serve, api=spec.name))
        for path in SCALE_OUT_PATHS:
            app.router.add_post(path, self.scale_out)
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

    async def scale_out(self, request: web.Request) -> web.Response:
        """vLLM's scale-out routes, answered as `vllm serve` without --enable-scale-out answers them (403,
        vLLM's error body), before the body is read: no LM serves them."""
        metrics.REQUESTS.labels("scale_out", "403").inc()
        headers = {REQUEST_ID_HEADER: request.get(REQUEST_ID_KEY) or uuid.uuid4().hex}
        return error_response(ApiError(403, SCALE_OUT_DISABLED, "PermissionDeniedError"), headers)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api="chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api="completions")

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        """Every API's request: its body read under the intake's bounds, then the core (parse with the
        API's media reader, admission, media, encode -> LM), then the answer relayed (``_respond``)."""
        spec = API[api]
        given = request.get(REQUEST_ID_KEY)
        rid = given or uuid.uuid4().hex
        request[REQUEST_ID_KEY] = rid
        headers = {REQUEST_ID_HEADER: rid}
        lease = None
        try:
            raw, lease = await self.intake.read(request)
            admitted = await self.core.admit(api, raw, client_id=rid, id_given=bool(given), path=request.path,
                                             lease=lease, arrival=request.get(ARRIVAL_KEY),
                                             content_type=request.headers.get("Content-Type", ""),
                                             tenant=request.get(TENANT_KEY, ANONYMOUS))
        except (ApiError, BodyRefused) as e:
            if isinstance(e, BodyRefused):
                if lease is not None:
                    lease.release()
                e = body_refused(e)
            metrics.REQUESTS.labels(api, str(e.status)).inc()
            return error_response(e, headers, spec.anthropic)
        gen = admitted.generate()
        slow = False
        try:
            response = await self._respond(request, admitted.req, admitted.call, len(admitted.media), gen,
                                           admitted.timings)
            if not response.prepared:  # sent here, under the deadline, while the request still holds it
                if isinstance(response, web.Response) and response.body is not None:
                    lease.hold(len(response.body))
                await self._send(request, response, None)
            return response
        except SlowReader as e:
            slow = True
            SLOW_READERS.inc()
            logger.info("request %s: %s; cancelling its LM call", admitted.req.request_id, e)
            return web.Response(status=408)  # never sent: the connection is closed below
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("request %s: the client went away after %.0f ms; cancelling its LM call",
                        admitted.req.request_id, admitted.timings.since_start_ms())
            raise
        finally:
            # A client that went away (or any error) must cancel the LM call now,
            # which aborts the engine request and frees what it holds; then its places go back, even if
            # a cancel interrupts the first.
            try:
                await gen.aclose()
            finally:
                admitted.close()
                if slow and request.transport is not None:
                    _reset(request.transport)

    async def _send(self, request: web.Request, response: web.StreamResponse, data: bytes | None) -> None:
        """Writes ``data`` (None: prepares ``response`` if needed and ends it) within the answer deadline:
        ``--answer-timeout-s`` plus the bytes at ``--answer-min-rate-kib``. A client that does not take
        them in time is cut off (``SlowReader``): ``_serve`` releases what it holds, then closes its
        connection, so aiohttp's buffer goes too."""
        size = len(data) if data is not None else len(getattr(response, "body", None) or b"")
        limit = self.cfg.answer_timeout_s + size / (self.cfg.answer_min_rate_kib * 1024)
        try:
            async with asyncio.timeout(limit):
                if data is not None:
                    await response.write(data)
                else:
                    if not response.prepared:
                        await response.prepare(request)
                    await response.write_eof()
        except TimeoutError:
            raise SlowReader(f"the client did not read {size} bytes of its answer within {limit:.1f} s "
                             "(--answer-timeout-s, --answer-min-rate-kib)") from None

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
        async with asyncio.timeout(self.cfg.answer_timeout_s):
            await response.prepare(request)
        done, last = b"", None
        try:
            resp = first
            async for resp in _chain(first, gen):
                if resp.openai.startswith(b"data: [DONE]"):
                    done = resp.openai  # after the epd comment
                elif resp.openai:
                    await self._send(request, response, resp.openai)
                else:
                    last = resp
            finished(route, 200, rid, timings, n_media, engine_id=req.request_id)
        except grpc.aio.AioRpcError as e:
            # Past the first event there is no retry: the stream ends with an error event.
            err = from_grpc(e, rid, self.cfg.epd_facts)
            finished(route, err.status, rid, timings, n_media, e.details() or "", engine_id=req.request_id)
            event = b"event: error\n" if spec.anthropic else b""
            await self._send(request, response,
                             event + b"data: " + json.dumps(error_body(err, spec.anthropic)).encode() + b"\n\n")
        if self.cfg.epd_facts:
            await self._send(request, response, b": epd " + json.dumps(epd_facts(timings, last)).encode() + b"\n\n")
        if spec.done:
            await self._send(request, response, done or b"data: [DONE]\n\n")
        elif done:
            await self._send(request, response, done)
        await self._send(request, response, None)
        return response


async def _chain(first, rest):
    yield first
    async for x in rest:
        yield x


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


def _reset(transport: asyncio.BaseTransport) -> None:
    """Closes a slow reader's connection with a reset: what aiohttp still buffers for it goes, and with
    SO_LINGER 0 so does what the kernel queued (a plain close leaves the socket to the kernel, which goes on
    trying to deliver its bytes to a client that does not read, for minutes)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
