"""Native gRPC API (GatewayService): every REST endpoint over gRPC, through the same request core.

A request is the REST body (``services.gateway.request.parse_openai``), with raw media allowed as
``epd-media:N``; the answer is what REST sends: vLLM's JSON, one event's data per message when
streaming. An error the REST API would answer with an HTTP status ends the call with that status's
gRPC code (``errors.grpc_code``: the one table) and the message.
"""

from __future__ import annotations

import json
import re
import uuid

import grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.errors import BadInput, EPDError
from services.gateway.auth import CURRENT_TENANT
from services.gateway.config import GatewayConfig
from services.gateway.core import REQUEST_ID_HEADER, REQUEST_ID_RE, Admitted, RequestCore, epd_facts, finished
from services.gateway.errors import ApiError, from_grpc, grpc_code
from services.gateway.fetch import MediaFetcher
from services.gateway.grpc_intake import GRPC_LEASE
from services.gateway.orchestrator import Orchestrator
from services.gateway.request import API

_RESPONSE_ID = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class _Status(EPDError):
    """Ends the call with ``code`` and ``message`` (an upstream status, or an HTTP error's)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _http_error(status: int, payload: bytes) -> _Status:
    try:
        body = json.loads(payload)
        message = body["error"]["message"]  # OpenAI's shape, and Anthropic's ({"type": "error", "error": ...})
    except (ValueError, KeyError, TypeError):
        message = payload.decode(errors="replace")
    return _Status(grpc_code(status), message)


def _endpoint(api: str):
    """The RPC for the REST endpoint ``api`` (an OpenAIRequest: the REST body and raw media)."""
    async def rpc(self, request, context):
        async for out in self._serve(request, context, api):
            yield out

    rpc.__doc__ = f"The REST API's {API[api].method} {API[api].path}, over gRPC."
    return rpc


def _by_id_endpoint(api: str, path: str):
    """The RPC for a REST endpoint about one stored response (a ResponseRef)."""
    async def rpc(self, request, context):
        async for out in self._by_id(request, context, api, path):
            yield out

    rpc.__doc__ = f"The REST API's {API[api].method} {API[api].path}, over gRPC."
    return rpc


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None,
                 core: RequestCore | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) media URLs are
        refused."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher
        self.core = core or RequestCore(cfg, orch, fetcher)  # the server shares one with the REST API

    # One RPC per REST endpoint (request.APIS), each through ``_serve``.
    ChatCompletion = _endpoint("chat")
    Completion = _endpoint("completions")
    Responses = _endpoint("responses")
    GetResponse = _by_id_endpoint("responses_get", "/v1/responses/{}")
    CancelResponse = _by_id_endpoint("responses_cancel", "/v1/responses/{}/cancel")
    Messages = _endpoint("messages")
    CountTokens = _endpoint("count_tokens")
    Tokenize = _endpoint("tokenize")
    Detokenize = _endpoint("detokenize")
    Version = _endpoint("version")
    Transcription = _endpoint("transcriptions")
    Translation = _endpoint("translations")

    async def _by_id(self, request: gateway_pb2.ResponseRef, context, api: str, path: str):
        if not _RESPONSE_ID.fullmatch(request.response_id):
            raise BadInput(f"response_id must match {_RESPONSE_ID.pattern}")
        body = b"" if API[api].method == "GET" else b"{}"
        async for out in self._serve(gateway_pb2.OpenAIRequest(body=body, request_id=request.request_id), context,
                                     api, path.format(request.response_id)):
            yield out

    async def _serve(self, request: gateway_pb2.OpenAIRequest, context, api: str, path: str = ""):
        # OpenAIRequest.request_id, else the x-request-id call metadata (REST's header).
        rid = request.request_id or dict(context.invocation_metadata() or ()).get(REQUEST_ID_HEADER.lower(), "")
        if rid and not REQUEST_ID_RE.fullmatch(rid):
            raise BadInput(f"request_id ({REQUEST_ID_HEADER}) must match {REQUEST_ID_RE.pattern}")
        body = request.body
        request.ClearField("body")  # parsed below: the text goes (the media stay, shared with the call's sources)
        try:
            admitted = await self.core.admit(api, body, client_id=rid or uuid.uuid4().hex, id_given=bool(rid),
                                             path=path, media=list(request.media), tenant=CURRENT_TENANT.get(),
                                             lease=GRPC_LEASE.get())
        except ApiError as e:  # 429: RESOURCE_EXHAUSTED, 503: UNAVAILABLE (retry later), 400s: INVALID_ARGUMENT
            raise _Status(grpc_code(e.status), e.message) from None
        try:
            async for out in self._run(admitted):
                yield out
        finally:
            admitted.close()

    async def _run(self, admitted: Admitted):
        req, media, timings, call = admitted.req, admitted.media, admitted.timings, admitted.call
        rid = call.request_id
        route = "grpc"
        last = None
        stream = None
        try:
            async for resp in admitted.generate():
                if resp.http_status and resp.http_status != 200:
                    finished(route, resp.http_status, rid, timings, len(media), resp.openai[:200].decode(errors="replace"),
                             engine_id=req.request_id)
                    raise _http_error(resp.http_status, resp.openai)
                if stream is None:
                    stream = resp.content_type.startswith("text/event-stream") if resp.content_type else call.stream
                if not resp.openai:
                    last = resp
                    continue
                for event in _events(resp.openai, stream):
                    yield gateway_pb2.OpenAIResponse(body=event)
        except grpc.aio.AioRpcError as e:
            err = from_grpc(e, rid, self.cfg.epd_facts)
            finished(route, err.status, rid, timings, len(media), e.details() or "", engine_id=req.request_id)
            raise _Status(e.code(), err.message) from None
        finished(route, 200, rid, timings, len(media), engine_id=req.request_id)
        if self.cfg.epd_facts:
            yield gateway_pb2.OpenAIResponse(epd=json.dumps(epd_facts(timings, last)).encode())


def _events(payload: bytes, stream: bool) -> list[bytes]:
    """The JSON objects in one LM message: the whole body, or the data of its server-sent events."""
    if not stream:
        return [payload]
    out = []
    for line in payload.split(b"\n"):
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            out.append(line[6:])
    return out
