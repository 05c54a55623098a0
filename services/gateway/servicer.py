"""Native gRPC API (GatewayService.ChatCompletion): same path as the REST API."""

from __future__ import annotations

import uuid

import grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput, EPDError
from services.common.media import content_id
from services.gateway.config import GatewayConfig
from services.gateway.openai_api import ApiError, _image_bytes
from services.gateway.orchestrator import Media, Orchestrator, Timings


class _Relay(EPDError):
    """Carries an upstream gRPC status through the error boundary unchanged."""

    def __init__(self, e: grpc.aio.AioRpcError) -> None:
        super().__init__(e.details())
        self.code = e.code()


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, cfg: GatewayConfig, orch: Orchestrator) -> None:
        self.cfg, self.orch = cfg, orch

    def _convert(self, request: gateway_pb2.ChatCompletionRequest):
        if not request.messages:
            raise BadInput("messages is required")
        req = lm_pb2.GenerateRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", sampling=request.sampling)
        media: list[Media] = []
        for m in request.messages:
            msg = req.chat.messages.add(role=m.role or "user")
            for part in m.content:
                if part.WhichOneof("part") == "text":
                    msg.content.add(text=part.text)
                    continue
                img = part.image
                if len(media) >= self.cfg.max_images:
                    raise BadInput(f"at most {self.cfg.max_images} images per request")
                try:
                    data = img.data if img.WhichOneof("source") == "data" else _image_bytes(img.url, self.cfg)
                except ApiError as e:
                    raise BadInput(e.message) from None
                if len(data) > self.cfg.max_image_bytes:
                    raise BadInput(f"image larger than {self.cfg.max_image_bytes} bytes")
                ident = content_id(data)
                msg.content.add(item_index=len(media))
                req.items.add(modality="image", identifier=ident, data=data)
                media.append(Media(data, ident))
        return req, media

    async def ChatCompletion(self, request, context):
        req, media = self._convert(request)
        try:
            async for resp in self.orch.generate(req, media, Timings()):
                yield gateway_pb2.ChatCompletionChunk(
                    id=req.request_id, text=resp.text, token_ids=resp.token_ids,
                    finish_reason=resp.finish_reason, usage=resp.usage if resp.finish_reason else None)
        except grpc.aio.AioRpcError as e:
            raise _Relay(e) from None


