"""Native gRPC API (GatewayService.ChatCompletion): same path as the REST API."""

from __future__ import annotations

import uuid

import grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput, EPDError, PeerUnavailable
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher
from services.gateway.openai_api import (
    REQUEST_ID_HEADER,
    REQUEST_ID_RE,
    check_sampling,
    engine_request_id,
    finished,
    from_grpc,
    load_media,
)
from services.gateway.orchestrator import Media, Orchestrator, Timings


class _Relay(EPDError):
    """Carries an upstream gRPC status through the error boundary unchanged."""

    def __init__(self, e: grpc.aio.AioRpcError) -> None:
        super().__init__(e.details())
        self.code = e.code()


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator, *, fetcher: MediaFetcher | None = None) -> None:
        """``fetcher``: owned by ``server.serve`` (which closes it); without one http(s) image URLs are
        refused."""
        self.cfg, self.orch, self.fetcher = cfg, orch, fetcher

    async def _convert(self, request: gateway_pb2.ChatCompletionRequest) -> tuple[lm_pb2.GenerateRequest,
                                                                                  list[Media]]:
        """The LM request and its media; images load as on the REST path (``load_media``: data:
        and http(s) URLs or raw bytes, every header checked). Raises BadInput (MediaError for
        images), which the error boundary answers with INVALID_ARGUMENT."""
        if not request.messages:
            raise BadInput("messages is required")
        problem = check_sampling(request.sampling)
        if problem is not None:
            raise BadInput(problem[1])
        req = lm_pb2.GenerateRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", sampling=request.sampling)
        sources: list[str | bytes] = []
        for m in request.messages:
            msg = req.chat.messages.add(role=m.role or "user")
            for part in m.content:
                if part.WhichOneof("part") == "text":
                    msg.content.add(text=part.text)
                    continue
                img = part.image
                if len(sources) >= self.cfg.max_images:
                    raise BadInput(f"at most {self.cfg.max_images} images per request")
                msg.content.add(item_index=len(sources))
                sources.append(img.data if img.WhichOneof("source") == "data" else img.url)
        return req, await load_media(req, sources, self.cfg, self.fetcher)

    async def ChatCompletion(self, request, context):
        timings = Timings()
        rid = dict(context.invocation_metadata() or ()).get(REQUEST_ID_HEADER.lower(), "")
        if rid and not REQUEST_ID_RE.fullmatch(rid):
            raise BadInput(f"{REQUEST_ID_HEADER.lower()} metadata must match {REQUEST_ID_RE.pattern}")
        why = self.orch.lm_wait_reason()
        if why is not None:  # before any image is loaded: nothing could take the request
            raise PeerUnavailable(why)
        req, media = await self._convert(request)
        # The client's id names the chunks and the log line; the engines get it made unique.
        req.request_id = engine_request_id(rid, "chatcmpl") if rid else req.request_id
        rid = rid or req.request_id
        try:
            async for resp in self.orch.generate(req, media, timings):
                yield gateway_pb2.ChatCompletionChunk(
                    id=rid, text=resp.text, token_ids=resp.token_ids,
                    finish_reason=resp.finish_reason, usage=resp.usage if resp.finish_reason else None)
        except grpc.aio.AioRpcError as e:
            finished("grpc", from_grpc(e).status, rid, timings, len(media), e.details() or "",
                     engine_id=req.request_id)
            raise _Relay(e) from None
        finished("grpc", 200, rid, timings, len(media), engine_id=req.request_id)


