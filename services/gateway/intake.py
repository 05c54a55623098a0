"""Request bodies before admission: how many are read at once, how many bytes they may hold, and
how long one may take, on both public ports. Anyone who can reach the gateway gets this far.

- A body larger than ``GatewayConfig.max_body_bytes`` (the largest media item one modality
  allows, base64, and some text) is refused with 413: by its Content-Length before a byte is
  read, else as soon as it grows past the limit.
- At most ``--max-body-readers`` bodies are being read at once; one more is refused at once
  (503, Retry-After: 1).
- Every body must arrive within ``--body-timeout-s`` (a slow drip is cut off: 408).
- Every request holds ``BODY_COPIES`` times its body's size from one budget, ``--body-memory-mib``,
  from its first byte until its answer ends (the text, what is parsed from it, and the media
  decoded from that), so what all requests hold is bounded, read, parsed, waiting for admission
  or in flight. A chunk that does not fit within ``WAIT_S`` ends its request with 503.

REST reads the body itself (aiohttp pauses the socket while a handler is not reading, so an
unread body holds at most its buffer). The native gRPC API's calls go through ``GrpcIntake``, a
server interceptor: it gives each GatewayService call a handler that reserves the largest body
from the budget *before* grpc reads the request message (a request-streaming handler; grpc
buffers only its flow-control window until the handler reads), reads it under the deadline, and
keeps what the message really needs.

Owner: ``server.serve`` makes one ``Intake``; the REST routes and ``GrpcIntake`` use it on the
gateway's event loop. A ``BodyLease`` is released by whoever took it when the request ends
(idempotent).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web
from prometheus_client import Counter, Gauge

from services.common.media import ByteBudget
from services.gateway.config import BODY_COPIES, GatewayConfig

logger = logging.getLogger(__name__)

WAIT_S = 1.0
"""How long a chunk waits for room in the body budget before its request is refused."""
CHUNK = 64 << 10

REFUSED = Counter("epd_gateway_bodies_refused_total", "Request bodies refused before admission", ["reason"])
HELD = Gauge("epd_gateway_body_bytes_held", "Budget held by request bodies (BODY_COPIES per byte)")
READING = Gauge("epd_gateway_bodies_reading", "Request bodies being read")


class BodyRefused(Exception):
    """A body the gateway will not take: ``status`` 408, 413 or 503, with a message."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        REFUSED.labels(reason).inc()


class BodyLease:
    """A request's share of the body budget; ``release`` when its answer ends (idempotent)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.nbytes = 0

    async def grow(self, nbytes: int) -> None:
        if not await self._budget.acquire(nbytes, WAIT_S):
            raise BodyRefused(503, f"the gateway holds {self._budget.used >> 20} MiB of request bodies, its limit "
                                   "(--body-memory-mib); retry later", "memory")
        self.nbytes += nbytes
        HELD.inc(nbytes)

    def shrink_to(self, nbytes: int) -> None:
        if nbytes < self.nbytes:
            self._budget.release(self.nbytes - nbytes)
            HELD.dec(self.nbytes - nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        self.shrink_to(0)


class Intake:
    """The limits above, shared by the REST and gRPC front ends."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.max_body = cfg.max_body_bytes
        self.budget = ByteBudget(int(cfg.body_memory_mib * (1 << 20)))
        self.reading = 0

    def start_reading(self) -> None:
        if self.reading >= self.cfg.max_body_readers:
            raise BodyRefused(503, f"the gateway is reading {self.reading} request bodies, its limit "
                                   "(--max-body-readers); retry later", "readers")
        self.reading += 1
        READING.inc()

    def done_reading(self) -> None:
        self.reading -= 1
        READING.dec()

    def _too_large(self, n: int) -> BodyRefused:
        return BodyRefused(413, f"request body of {n} bytes or more is larger than the {self.max_body} allowed "
                                "(set by --max-image-bytes, --max-audio-bytes and --max-video-bytes)", "size")

    async def read(self, request: web.Request) -> tuple[bytes, BodyLease]:
        """A REST request's body and its lease. Raises BodyRefused (nothing held then)."""
        if request.content_length is not None and request.content_length > self.max_body:
            raise self._too_large(request.content_length)
        self.start_reading()
        lease, buf = BodyLease(self.budget), bytearray()
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                while chunk := await request.content.read(CHUNK):
                    if len(buf) + len(chunk) > self.max_body:
                        raise self._too_large(len(buf) + len(chunk))
                    await lease.grow(BODY_COPIES * len(chunk))
                    buf += chunk
        except TimeoutError:
            lease.release()
            raise BodyRefused(408, f"the request body did not arrive within {self.cfg.body_timeout_s:g} s "
                                   "(--body-timeout-s)", "timeout") from None
        except BaseException:
            lease.release()
            raise
        finally:
            self.done_reading()
        return bytes(buf), lease

    async def reserve_message(self) -> BodyLease:
        """A gRPC call's lease for its one request message, before grpc reads it: the largest body.
        Raises BodyRefused."""
        self.start_reading()
        lease = BodyLease(self.budget)
        try:
            await lease.grow(BODY_COPIES * self.max_body)
        except BaseException:
            self.done_reading()
            raise
        return lease


class GrpcIntake(grpc.aio.ServerInterceptor):
    """The intake limits on the gateway's native gRPC API (see the module docstring): each
    GatewayService call (one request message, a stream of answers) gets a request-streaming
    handler that takes the body budget and a reader slot before grpc reads the message, reads it
    within ``--body-timeout-s``, and hands it to the servicer's own handler; the lease is held
    until the call ends."""

    SERVICE = "/epd.gateway.v1.GatewayService/"

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.SERVICE) or handler.request_streaming \
                or not handler.response_streaming:
            return handler
        intake, inner = self.intake, handler.unary_stream

        async def call(request_iterator, context):
            try:
                lease = await intake.reserve_message()
            except BodyRefused as e:
                await context.abort(_CODE[e.status], e.message)
            try:
                try:
                    async with asyncio.timeout(intake.cfg.body_timeout_s):
                        request = await anext(aiter(request_iterator), None)
                finally:
                    intake.done_reading()
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                lease.shrink_to(BODY_COPIES * request.ByteSize())
                async for response in inner(request, context):
                    yield response
            except TimeoutError:
                REFUSED.labels("timeout").inc()
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request message did not arrive within "
                                    f"{intake.cfg.body_timeout_s:g} s (--body-timeout-s)")
            finally:
                lease.release()

        return grpc.stream_stream_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


_CODE = {408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         503: grpc.StatusCode.UNAVAILABLE}
