"""OpenAI-compatible REST: request parsing, responses, SSE, and the one
function that maps gRPC status codes to OpenAI-style HTTP errors."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.common.media import content_id
from services.gateway import metrics
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher, load_images
from services.gateway.orchestrator import Media, Orchestrator, Timings

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


def from_grpc(e: grpc.aio.AioRpcError) -> ApiError:
    """The one place gRPC codes become HTTP errors."""
    status, type_ = _HTTP_STATUS.get(e.code(), (500, "server_error"))
    return ApiError(status, e.details() or e.code().name, type_)


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(e), status=e.status, headers=headers)


def loads_strict(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259): unlike ``json.loads`` it refuses the NaN, Infinity and
    -Infinity literals. Raises ApiError (400)."""
    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def _integer(body: dict[str, Any], name: str, minimum: int | None, param: str | None = None) -> int | None:
    """``body[name]`` when it is an integer (not a bool, not a float such as 1.9 or 2.0) of at least
    ``minimum``; None when absent or null. Raises ApiError (400)."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (minimum is not None and v < minimum):
        need = "an integer" if minimum is None else ("a positive integer" if minimum == 1 else
                                                      f"an integer >= {minimum}")
        raise ApiError(400, f"{name} must be {need}, got {json.dumps(v)}", param=param or name)
    return v


# Allowed ranges of the float sampling fields, as vLLM checks them: (low, low inclusive, high).
_FLOAT_RANGES = {"temperature": (0.0, True, math.inf), "top_p": (0.0, False, 1.0)}


def check_sampling(s: lm_pb2.SamplingOptions) -> tuple[str, str] | None:
    """The first problem with ``s`` as (field, message), or None. Shared by the REST parser and the gRPC
    API, whose SamplingOptions arrive as they are: a NaN or infinite temperature or top_p (JSON bodies
    can carry the literals; a float32 overflows to infinity) must not reach the engine."""
    for name, (low, inclusive, high) in _FLOAT_RANGES.items():
        if not s.HasField(name):
            continue
        v = getattr(s, name)
        if not math.isfinite(v):
            return name, f"{name} must be a finite number, got {v}"
        if v < low or (v == low and not inclusive) or v > high:
            bounds = f"{'[' if inclusive else '('}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
            return name, f"{name} must be in {bounds}, got {v:g}"
    if s.HasField("n") and s.n < 1:
        return "n", f"n must be a positive integer, got {s.n}"
    return None


def _sampling(body: dict[str, Any]) -> lm_pb2.SamplingOptions:
    s = lm_pb2.SamplingOptions()
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    try:
        max_tokens = _integer(body, tokens_field, 1, param="max_tokens")
        if max_tokens is not None:
            s.max_tokens = max_tokens
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                if not isinstance(body[name], (int, float)) or isinstance(body[name], bool):
                    raise ApiError(400, f"{name} must be a number", param=name)
                setattr(s, name, float(body[name]))
        seed = _integer(body, "seed", None)
        if seed is not None:
            s.seed = seed
        n = _integer(body, "n", 1)
        if n is not None:
            s.n = n
        s.ignore_eos = body.get("ignore_eos") is True
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"bad sampling parameter: {e}") from None
    problem = check_sampling(s)
    if problem is not None:
        raise ApiError(400, problem[1], param=problem[0])
    stop = body.get("stop")
    if isinstance(stop, str):
        s.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop.extend(stop)
    elif stop is not None:
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return s


def _check_stream(body: dict[str, Any]) -> None:
    """``stream`` a boolean and ``stream_options`` an object (``include_usage`` a boolean), checked
    before the response starts: a bad value found mid-stream could only break the stream."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise ApiError(400, f"stream_options must be an object, got {type(opts).__name__}", param="stream_options")
    if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", param="stream_options")


def engine_request_id(client_id: str, prefix: str) -> str:
    """The id the encoders and the LM see for one request: the client's ``X-Request-Id`` with a random
    suffix (clients may send the same id twice; an engine needs unique ones, and the client's id still
    finds the request in every service's logs), or ``<prefix>-<uuid>`` without one."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


def media_api_error(e: MediaError) -> ApiError:
    """A refused image as the REST API answers it (``OpenAIRoutes.chat``): 400 or 413, param image_url."""
    return ApiError(e.status, str(e), param="image_url")


async def load_media(req: lm_pb2.GenerateRequest, sources: list[str | bytes], cfg: GatewayConfig,
                     fetcher: MediaFetcher | None) -> list[Media]:
    """The second, async half of parsing (``OpenAIRoutes.chat`` after ``parse_chat``, and
    ``GatewayServicer``): loads every image source (data: decoded, http(s) fetched concurrently,
    every header checked), appends the items to ``req`` in order and returns them as Media.
    Raises MediaError; REST callers turn it into ApiError, gRPC lets the error boundary map it."""
    try:
        images = await load_images(sources, cfg, fetcher)
    except MediaError as e:
        logger.info("request %s: image refused (%d): %s", req.request_id, e.status, e)
        raise
    media = []
    for data in images:
        ident = content_id(data)
        req.items.add(modality="image", identifier=ident, data=data)
        media.append(Media(data, ident))
    return media


def parse_chat(body: Any, cfg: GatewayConfig, request_id: str = "") -> tuple[lm_pb2.GenerateRequest, list[str]]:
    """Validates a chat body and builds the LM request without any I/O (``OpenAIRoutes.chat``).
    Image parts become ``item_index`` placeholders; their URLs are returned in order for
    ``load_media``, which adds the items themselves. ``request_id``: the client's, made unique for
    the engines (``engine_request_id``). Raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list", param="messages")
    _check_stream(body)
    req = lm_pb2.GenerateRequest(request_id=engine_request_id(request_id, "chatcmpl"), sampling=_sampling(body))
    urls: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        msg = req.chat.messages.add(role=m["role"])
        content = m.get("content")
        if isinstance(content, str):
            msg.content.add(text=content)
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                msg.content.add(text=part["text"])
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ApiError(400, f"messages[{i}].content[{j}].image_url.url is required", param="messages")
                if len(urls) >= cfg.max_images:
                    raise ApiError(400, f"at most {cfg.max_images} images per request", param="messages")
                msg.content.add(item_index=len(urls))
                urls.append(url)
            else:
                raise ApiError(400, f"messages[{i}].content[{j}]: unsupported part type {kind!r}", param="messages")
    return req, urls


def parse_completion(body: Any, request_id: str = "") -> lm_pb2.GenerateRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' is required and must be a string", param="prompt")
    _check_stream(body)
    return lm_pb2.GenerateRequest(request_id=engine_request_id(request_id, "cmpl"), prompt=prompt,
                                  sampling=_sampling(body))


class OpenAIRoutes:
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused. The served model is ``orch.model``: unknown (every request 503) until an LM is admitted."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher

    @property
    def model(self) -> str:
        return self.orch.model or ""

    def _check_ready(self) -> None:
        """503, saying what the gateway waits for, until an LM has been admitted."""
        why = self.orch.lm_wait_reason()
        if why is not None:
            raise ApiError(503, why, "server_error")

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)

    async def _json(self, request: web.Request) -> Any:
        return loads_strict(await request.read())

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, "", self.model):
            raise ApiError(404, f"model {model!r} does not exist; this gateway serves {self.model!r}",
                           "not_found_error", "model")

    async def models(self, request: web.Request) -> web.Response:
        """The served model; 503 (as every request, so clients retry) while it is not known yet."""
        if self.orch.model is None:
            return error_response(ApiError(503, self.orch.lm_wait_reason() or "no LM is ready yet", "server_error"))
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "epd-serve"}]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one LM is admitted (a readiness probe), else 503 with
        the reason; the body lists every instance (admitted or not), why each one
        that is out is out, and the served model."""
        instances = self.orch.health()
        ok = any(instances.get("lms", {}).values())
        status = "ok" if ok else self.orch.lm_wait_reason() or "no healthy LM"
        return web.json_response({"status": status, "model": self.orch.model, **instances,
                                  "out": self.orch.not_admitted()}, status=200 if ok else 503)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            req, urls = parse_chat(body, self.cfg, request.get(REQUEST_ID_KEY, ""))
            self._check_ready()
            self._check_model(body)
            media = await load_media(req, urls, self.cfg, self.fetcher)
        except (ApiError, MediaError) as e:
            err = e if isinstance(e, ApiError) else media_api_error(e)
            metrics.REQUESTS.labels("chat", str(err.status)).inc()
            return error_response(err)
        return await self._run(request, req, media, body, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            req = parse_completion(body, request.get(REQUEST_ID_KEY, ""))
            self._check_ready()
            self._check_model(body)
        except ApiError as e:
            metrics.REQUESTS.labels("completions", str(e.status)).inc()
            return error_response(e)
        return await self._run(request, req, [], body, chat=False)

    async def _run(self, request, req, media, body, chat: bool) -> web.StreamResponse:
        timings = Timings(start=request.get(ARRIVAL_KEY) or time.perf_counter())
        stream = body.get("stream") is True
        created = int(time.time())
        gen = self.orch.generate(req, media, timings)
        try:
            return await self._respond(request, req, media, body, chat, stream, created, gen, timings)
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("request %s: the client went away after %.0f ms; cancelling its LM call",
                        req.request_id, timings.since_start_ms())
            raise
        finally:
            # A client that went away (or any error) must cancel the LM call now,
            # which aborts the engine request and frees what it holds.
            await gen.aclose()

    async def _respond(self, request, req, media, body, chat, stream, created, gen, timings) -> web.StreamResponse:
        route = "chat" if chat else "completions"
        # The client's id (X-Request-Id) answers and logs; the engines saw it made unique (req.request_id).
        rid = request.get(REQUEST_ID_KEY) or req.request_id
        headers = {REQUEST_ID_HEADER: rid}
        if not stream:
            text, ids, final = [], [], None
            try:
                async for resp in gen:
                    text.append(resp.text)
                    ids.extend(resp.token_ids)
                    final = resp
            except grpc.aio.AioRpcError as e:
                err = from_grpc(e)
                finished(route, err.status, rid, timings, len(media), err.message, engine_id=req.request_id)
                return error_response(err, headers)
            finished(route, 200, rid, timings, len(media), engine_id=req.request_id)
            return web.json_response(self._full(rid, created, "".join(text), ids, final, timings, chat),
                                     headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **headers})
        await response.prepare(request)
        first = True
        try:
            async for resp in gen:
                if chat and first:
                    await _sse(response, self._chunk(rid, created, {"role": "assistant", "content": ""},
                                                     None, chat))
                    first = False
                if resp.text or resp.token_ids or resp.finish_reason:
                    delta = {"content": resp.text} if chat else resp.text
                    await _sse(response, self._chunk(rid, created, delta, resp.finish_reason or None,
                                                     chat, list(resp.token_ids)))
                if resp.finish_reason and (body.get("stream_options") or {}).get("include_usage") is True:
                    await _sse(response, {"id": rid, "object": _obj(chat, True), "created": created,
                                          "model": self.model, "choices": [], "usage": _usage(resp)})
            finished(route, 200, rid, timings, len(media), engine_id=req.request_id)
        except grpc.aio.AioRpcError as e:
            # Past the first token there is no retry: the stream ends with an error event.
            err = from_grpc(e)
            finished(route, err.status, rid, timings, len(media), err.message, engine_id=req.request_id)
            await _sse(response, error_body(err))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _chunk(self, rid, created, delta, finish, chat, token_ids=None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {"id": rid, "object": _obj(chat, True), "created": created, "model": self.model, "choices": [choice]}

    def _full(self, rid, created, text, ids, final, timings: Timings, chat: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason if final else "stop",
                                  "token_ids": ids}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid, "object": _obj(chat, False), "created": created, "model": self.model,
            "choices": [choice], "usage": _usage(final),
            "epd": {"timings": timings.as_dict(),
                    "local_encoder_runs": final.local_encoder_runs if final else 0,
                    "transferred_items": final.transferred_items if final else 0,
                    "transports": timings.transports, "encoders": timings.encoders, "lm": timings.lm,
                    "retries": timings.retries},
        }


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


def _obj(chat: bool, chunk: bool) -> str:
    return ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")


def _usage(final) -> dict[str, int]:
    p = final.usage.prompt_tokens if final else 0
    c = final.usage.completion_tokens if final else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _sse(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
