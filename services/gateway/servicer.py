"""Native gRPC API (GatewayService): the OpenAI API over gRPC, on the REST path.

A request is the REST body (``parse_openai``), with raw image bytes allowed as
``epd-media:N``; the answer is what REST sends: vLLM's JSON, one chunk per
message when streaming. An error status the REST API would send becomes the
matching gRPC code with vLLM's message.
"""

from __future__ import annotations

import json
import uuid

import grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput, EPDError, PeerUnavailable
from services.gateway.admission import AdmissionRefused
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher
from services.gateway.openai_api import (
    REQUEST_ID_HEADER,
    REQUEST_ID_RE,
    ApiError,
    engine_request_id,
    epd_facts,
    finished,
    from_grpc,
    load_media,
    parse_openai,
)
from services.gateway.orchestrator import Orchestrator, Timings

# HTTP statuses of REST answers as gRPC codes (the inverse of openai_api's mapping).
_GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
              413: grpc.StatusCode.RESOURCE_EXHAUSTED, 422: grpc.StatusCode.INVALID_ARGUMENT,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
              501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE,
              504: grpc.StatusCode.DEADLINE_EXCEEDED}


class _Status(EPDError):
    """Ends the call with ``code`` and ``message`` (an upstream status, or an HTTP error's)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _http_error(status: int, payload: bytes) -> _Status:
    try:
        message = json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = payload.decode(errors="replace")
    return _Status(_GRPC_CODE.get(status, grpc.StatusCode.INTERNAL), message)


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher

    async def ChatCompletion(self, request, context):
        async for out in self._serve(request, context, "chat", "chatcmpl"):
            yield out

    async def Completion(self, request, context):
        async for out in self._serve(request, context, "completions", "cmpl"):
            yield out

    async def _serve(self, request: gateway_pb2.OpenAIRequest, context, api: str, prefix: str):
        timings = Timings()
        # OpenAIRequest.request_id, else the x-request-id call metadata (REST's header).
        rid = request.request_id or dict(context.invocation_metadata() or ()).get(REQUEST_ID_HEADER.lower(), "")
        if rid and not REQUEST_ID_RE.fullmatch(rid):
            raise BadInput(f"request_id ({REQUEST_ID_HEADER}) must match {REQUEST_ID_RE.pattern}")
        why = self.orch.lm_wait_reason()
        if why is not None:  # before any image is loaded: nothing could take the request
            raise PeerUnavailable(why)
        try:
            call = parse_openai(api, request.body, self.cfg, list(request.media))
        except ApiError as e:
            raise _Status(_GRPC_CODE.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message) from None
        request.ClearField("body")  # parsed: the text goes (the media stay, shared with ``call.sources``)
        call.request_id, call.id_given = rid or uuid.uuid4().hex, bool(rid)
        rid = call.request_id
        req = lm_pb2.GenerateRequest(request_id=engine_request_id(rid, prefix))
        req.openai.api = api
        try:
            ticket = await self.orch.admission.admit(self.orch.encodes_remotely(len(call.parts)))
        except AdmissionRefused as e:  # 429: RESOURCE_EXHAUSTED, 503: UNAVAILABLE (retry later)
            raise _Status(_GRPC_CODE[e.status], e.message) from None
        try:
            async for out in self._run(call, req, rid, timings, ticket):
                yield out
        finally:
            ticket.release()
            call.drop_payload()
            req.ClearField("openai")

    async def _run(self, call, req, rid: str, timings: Timings, ticket):
        media = await load_media(call, req, self.cfg, self.fetcher)  # MediaError: INVALID_ARGUMENT
        try:
            route = "grpc"
            last = None
            try:
                async for resp in self.orch.generate(req, media, timings, ticket=ticket,
                                                     prepare=lambda r: setattr(r.openai, "body", call.lm_body(r, media))):
                    if resp.http_status and resp.http_status != 200:
                        finished(route, resp.http_status, rid, timings, len(media), resp.openai[:200].decode(errors="replace"),
                                 engine_id=req.request_id)
                        raise _http_error(resp.http_status, resp.openai)
                    if not resp.openai:
                        last = resp
                        continue
                    for event in _events(resp.openai, call.stream):
                        yield gateway_pb2.OpenAIResponse(body=event)
            except grpc.aio.AioRpcError as e:
                err = from_grpc(e, rid, self.cfg.epd_facts)
                finished(route, err.status, rid, timings, len(media), e.details() or "", engine_id=req.request_id)
                raise _Status(e.code(), err.message) from None
            finished(route, 200, rid, timings, len(media), engine_id=req.request_id)
            if self.cfg.epd_facts:
                yield gateway_pb2.OpenAIResponse(epd=json.dumps(epd_facts(timings, last)).encode())
        finally:
            media.clear()  # the bytes go with the answer, whatever refers to the list


def _events(payload: bytes, stream: bool) -> list[bytes]:
    """The JSON objects in one LM message: the whole body, or the data of its server-sent events."""
    if not stream:
        return [payload]
    out = []
    for line in payload.split(b"\n"):
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            out.append(line[6:])
    return out
