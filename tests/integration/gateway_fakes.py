"""In-process fake encoder and LM gRPC servers for the gateway's tests (one
place for them): a shared ``World`` records what every fake saw, in order, and
holds the scripts the next calls follow. ``serve_fake`` puts one fake on a real
``grpc.aio`` server with grpc.health.v1 readiness (and, given a ``SecurityConfig``,
the real token check), as the real services do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from ectransfer.security import SecurityConfig
from epd.common.v1 import common_pb2
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.common.errors import BadInput, EncoderUnavailable, Forbidden, PeerUnavailable
from services.common.grpc_server import GrpcServer

ENCODER_SERVICE = "epd.encoder.v1.EncoderService"
LM_SERVICE = "epd.lm.v1.LMService"


class World:
    """What the fakes share: an ordered log of events, per-request "the LM
    call arrived" events, and scripts that the next calls (to whichever
    instance gets them) follow."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []  # (who, what, request_id)
        self.enc_script: list[str] = []
        self.lm_script: list[str] = []
        self._lm_arrived: dict[str, asyncio.Event] = {}
        self.release = asyncio.Event()

    def lm_arrived(self, rid: str) -> asyncio.Event:
        return self._lm_arrived.setdefault(rid, asyncio.Event())

    def at(self, what: str, rid: str) -> int:
        """Position in the log of the first ``what`` event of request ``rid``."""
        return next(n for n, (_, w, r) in enumerate(self.log) if (w, r) == (what, rid))


class FakeEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Streams ItemMetadata per item (transfer_endpoint ``<name>:1``), waits
    for the LM call of the same request (``wait_lm_s``), then ItemEncoded per
    item; GetInfo names it and its endpoint. Scripted modes: unavailable,
    abort_unavailable, invalid, unauthenticated (as a server refusing the
    caller's token), hang, fail_after_metadata, fail_when_released (after
    metadata, once ``world.release`` is set), late_encoded (0.3 s after the LM
    call)."""

    def __init__(self, name: str, world: World, wait_lm_s: float = 2.0) -> None:
        self.name, self.world, self.wait_lm_s = name, world, wait_lm_s
        self.endpoint = f"{name}:1"
        self.requests: list[encoder_pb2.EncodeRequest] = []
        self.cancelled: list[str] = []
        self.mode = "ok"
        self.layout = False  # send a prompt layout with the metadata, as the real encoder does

    async def Encode(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        mode = self.world.enc_script.pop(0) if self.world.enc_script else self.mode
        self.world.log.append((self.name, "encode", rid))
        if mode == "unavailable":
            raise PeerUnavailable(f"{self.name} is going away")
        if mode == "abort_unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} overloaded")
        if mode == "invalid":
            raise BadInput("not an image")
        if mode == "unauthenticated":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refuses the caller's token")
        if mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        for i, item in enumerate(request.items):
            md = encoder_pb2.ItemMetadata(
                identifier=item.identifier, index=i, modality=item.modality, num_embeds=16, embed_width=64,
                dtype=common_pb2.BFLOAT16, transfer_endpoint=self.endpoint, encoder_id=self.name)
            if self.layout:
                md.placeholder_token_ids.append(9)
                md.prompt_token_ids.extend([5] * 16)
            yield encoder_pb2.EncodeEvent(metadata=md)
        self.world.log.append((self.name, "metadata", rid))
        if mode == "fail_when_released":
            await self.world.release.wait()
            self.world.log.append((self.name, "failed", rid))
            raise PeerUnavailable(f"{self.name} died after the LM pulled its items")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.world.lm_arrived(rid).wait(), self.wait_lm_s)
        if mode == "fail_after_metadata":
            raise PeerUnavailable(f"{self.name} died mid-encode")
        if mode == "late_encoded":  # the engine's last output comes after the LM answered
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        for i, item in enumerate(request.items):
            yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(identifier=item.identifier, index=i,
                                                                          encode_ms=5.0))
        self.world.log.append((self.name, "encoded", rid))

    async def GetInfo(self, request, context):
        return encoder_pb2.EncoderInfo(encoder_id=self.name, transfer_endpoint=self.endpoint)


class FakeLM(lm_pb2_grpc.LMServiceServicer):
    """Records each request, streams tokens [1, 2], [3], then "stop"; GetInfo
    names ``model``. Scripted modes: unavailable, encoder_unavailable, invalid,
    forbidden (PERMISSION_DENIED, as an LM whose encoder allow-list lacks the
    item's encoder), fail_after_first, block (until cancelled), first_then_block."""

    def __init__(self, name: str, world: World, model: str = "fake-model") -> None:
        self.name, self.world, self.model = name, world, model
        self.requests: list[lm_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        got = lm_pb2.GenerateRequest()
        got.CopyFrom(request)
        self.requests.append(got)
        rid = request.request_id
        self.world.log.append((self.name, "generate", rid))
        self.world.lm_arrived(rid).set()
        mode = self.world.lm_script.pop(0) if self.world.lm_script else "ok"
        if mode == "unavailable":
            raise PeerUnavailable(f"{self.name} is draining")
        if mode == "encoder_unavailable":  # as the real LM: names the encoder of the item it could not get
            raise EncoderUnavailable("the encoder freed the item before it was pulled",
                                     [request.items[0].source.transfer_endpoint])
        if mode == "encoder_unavailable_unnamed":  # the LM cannot tell which encoder failed
            raise EncoderUnavailable("the encoder output could not be obtained")
        if mode == "invalid":
            raise BadInput("prompt too long")
        if mode == "forbidden":
            raise Forbidden(f"{self.name} may not fetch from that encoder")
        if mode == "block":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        yield lm_pb2.GenerateResponse(request_id=rid, token_ids=[1, 2], text="ab")
        if mode == "fail_after_first":
            raise PeerUnavailable(f"{self.name} crashed mid-stream")
        if mode == "first_then_block":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        yield lm_pb2.GenerateResponse(request_id=rid, token_ids=[3], text="c")
        yield lm_pb2.GenerateResponse(request_id=rid, finish_reason="stop",
                                      usage=lm_pb2.Usage(prompt_tokens=5, completion_tokens=3),
                                      transferred_items=sum(1 for i in request.items if i.HasField("source")))

    async def GetInfo(self, request, context):
        return lm_pb2.LMInfo(model=self.model)


async def serve_fake(fake: FakeEncoder | FakeLM, port: int = 0,
                     security: SecurityConfig | None = None) -> tuple[GrpcServer, str]:
    """``fake`` on a started, SERVING GrpcServer on loopback (``security``: its TLS and token check, as a
    real service's); returns it and its ``127.0.0.1:port``. The caller stops the server."""
    server = GrpcServer("127.0.0.1", port, security)
    if isinstance(fake, FakeEncoder):
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, fake, ENCODER_SERVICE)
    else:
        server.add(lm_pb2_grpc.add_LMServiceServicer_to_server, fake, LM_SERVICE)
    port = await server.start()
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0
