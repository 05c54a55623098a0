"""OpenAI-compatible REST: request parsing, responses, SSE, and the one
function that maps gRPC status codes to OpenAI-style HTTP errors."""

from __future__ import annotations

import asyncio
import json
import logging
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


def _sampling(body: dict[str, Any]) -> lm_pb2.SamplingOptions:
    s = lm_pb2.SamplingOptions()
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        if max_tokens is not None:
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
                raise ApiError(400, "max_tokens must be a positive integer", param="max_tokens")
            s.max_tokens = max_tokens
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                if not isinstance(body[name], (int, float)) or isinstance(body[name], bool):
                    raise ApiError(400, f"{name} must be a number", param=name)
                setattr(s, name, float(body[name]))
        if body.get("seed") is not None:
            if not isinstance(body["seed"], int) or isinstance(body["seed"], bool):
                raise ApiError(400, "seed must be an integer", param="seed")
            s.seed = body["seed"]
        if body.get("n") is not None:
            s.n = int(body["n"])
        s.ignore_eos = body.get("ignore_eos") is True
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"bad sampling parameter: {e}") from None
    stop = body.get("stop")
    if isinstance(stop, str):
        s.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop.extend(stop)
    elif stop is not None:
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return s


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
    ``load_media``, which adds the items themselves. Raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list", param="messages")
    req = lm_pb2.GenerateRequest(request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}", sampling=_sampling(body))
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
    return lm_pb2.GenerateRequest(request_id=request_id or f"cmpl-{uuid.uuid4().hex}", prompt=prompt,
                                  sampling=_sampling(body))


class OpenAIRoutes:
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, model: str, *,
                 fetcher: MediaFetcher | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused."""
        self.cfg, self.orch, self.model, self.fetcher = cfg, orch, model, fetcher

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)

    async def _json(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, "", self.model):
            raise ApiError(404, f"model {model!r} does not exist; this gateway serves {self.model!r}",
                           "not_found_error", "model")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "epd-serve"}]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one LM is admitted (a readiness probe), else 503;
        the body lists every instance's state."""
        instances = self.orch.health()
        ok = any(instances.get("lms", {}).values())
        return web.json_response({"status": "ok" if ok else "no healthy LM", **instances}, status=200 if ok else 503)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json(request)
            req, urls = parse_chat(body, self.cfg, request.get(REQUEST_ID_KEY, ""))
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
            self._check_model(body)
        except ApiError as e:
            metrics.REQUESTS.labels("completions", str(e.status)).inc()
            return error_response(e)
        return await self._run(request, req, [], body, chat=False)

    async def _run(self, request, req, media, body, chat: bool) -> web.StreamResponse:
        timings = Timings(start=request.get(ARRIVAL_KEY) or time.perf_counter())
        stream = bool(body.get("stream"))
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
        headers = {REQUEST_ID_HEADER: req.request_id}
        if not stream:
            text, ids, final = [], [], None
            try:
                async for resp in gen:
                    text.append(resp.text)
                    ids.extend(resp.token_ids)
                    final = resp
            except grpc.aio.AioRpcError as e:
                err = from_grpc(e)
                finished(route, err.status, req.request_id, timings, len(media), err.message)
                return error_response(err, headers)
            finished(route, 200, req.request_id, timings, len(media))
            return web.json_response(self._full(req.request_id, created, "".join(text), ids, final, timings, chat),
                                     headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **headers})
        await response.prepare(request)
        first = True
        try:
            async for resp in gen:
                if chat and first:
                    await _sse(response, self._chunk(req.request_id, created, {"role": "assistant", "content": ""},
                                                     None, chat))
                    first = False
                if resp.text or resp.token_ids or resp.finish_reason:
                    delta = {"content": resp.text} if chat else resp.text
                    await _sse(response, self._chunk(req.request_id, created, delta, resp.finish_reason or None,
                                                     chat, list(resp.token_ids)))
                if resp.finish_reason and (body.get("stream_options") or {}).get("include_usage"):
                    await _sse(response, {"id": req.request_id, "object": _obj(chat, True), "created": created,
                                          "model": self.model, "choices": [], "usage": _usage(resp)})
            finished(route, 200, req.request_id, timings, len(media))
        except grpc.aio.AioRpcError as e:
            # Past the first token there is no retry: the stream ends with an error event.
            err = from_grpc(e)
            finished(route, err.status, req.request_id, timings, len(media), err.message)
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


def finished(route: str, status: int, rid: str, timings: Timings, media: int, error: str = "") -> None:
    """Metrics and the one log line per finished request (REST and gRPC)."""
    metrics.observe(route, status, timings, media)
    if status == 200:
        logger.info("request %s: 200 in %.1f ms (ttft %.1f ms, %d item(s), encoders %s, lm %s, retries %d)",
                    rid, timings.total_ms, timings.ttft_ms, media, ",".join(timings.encoders) or "-",
                    timings.lm or "-", timings.retries)
    else:
        logger.warning("request %s: %d after %.1f ms (lm %s, retries %d): %s",
                       rid, status, timings.total_ms, timings.lm or "-", timings.retries, error)


@web.middleware
async def request_context(request: web.Request, handler):
    """Stamps each request's arrival (the gateway queue stage starts here) and
    its id: a client's ``X-Request-Id`` (letters, digits, ``._-``, up to 64) is
    carried through the encoder and LM; otherwise the gateway makes one."""
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
