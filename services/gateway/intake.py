"""Request bodies before admission: how many are read at once, how many bytes they may hold, and
how long one may take, on both public ports. Anyone who can reach the gateway gets this far.

- A body larger than ``GatewayConfig.max_body_bytes`` (the largest media item one modality
  allows, base64, and some text) is refused with 413: by its Content-Length before a byte is
  read, else as soon as it grows past the limit.
- At most ``--max-body-readers`` bodies are being read at once; one more is refused at once
  (503, Retry-After: 1).
- A body must arrive within ``--body-timeout-s``, and after a grace of ``RATE_GRACE_S`` at no
  less than ``--body-min-rate-kib`` per second (a slow drip is cut off within seconds: 408).
- The budget, ``--body-memory-mib``, is charged for bytes a client delivered, never for a length it
  declared: a body being read holds what has arrived (once per byte, chunk by chunk); once it is all
  there it holds ``BODY_COPIES`` times its size (the text, what is parsed from it, the media decoded
  from that), plus twice the bytes of any media it fetched (``charge_fetched``), until its answer
  ends; a non-streaming answer's bytes are added while they wait to be sent (``BodyLease.hold``).
  So what all requests hold is bounded, read, parsed, waiting for admission or in flight, and a
  client that declares 64 MiB and drips holds only what it dripped (and the minimum rate below
  cuts it off). Room that is not there within ``WAIT_S`` is a 503. The budget is not
  first-come-first-served: a small body never waits behind a large one.

REST reads the body itself (aiohttp pauses the socket while a handler is not reading, so an
unread body holds at most its buffer). The native gRPC API's calls go through ``GrpcIntake``, a
server interceptor: it gives each GatewayService call a handler that takes one of
``GRPC_READERS`` read slots (waiting ``WAIT_S`` for one) and twice the largest body from the budget *before* grpc reads the
request message (a request-streaming handler; grpc buffers only its flow-control window until the
handler reads), reads it under the deadline, and then keeps what the message needs. What a gRPC
call's message cannot do, unlike a REST body, is show its progress: a call that never sends its
message holds its slot until ``--body-timeout-s``, so at most ``GRPC_READERS`` such calls stall
the gRPC API (never the REST one) at a time.

Owner: ``server.serve`` makes one ``Intake``; the REST routes and ``GrpcIntake`` use it on the
gateway's event loop. A ``BodyLease`` is released by whoever took it when the request ends
(idempotent); ``CURRENT_LEASE`` lets the media loader charge fetched bytes to the request's lease.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time

import grpc
from aiohttp import web
from prometheus_client import Counter, Gauge

from services.common.errors import EPDError
from services.common.media import ByteBudget
from services.gateway.auth import CURRENT_TENANT
from services.gateway.config import BODY_COPIES, GatewayConfig
from services.gateway.tenants import ANONYMOUS

logger = logging.getLogger(__name__)

WAIT_S = 1.0
"""How long a request waits for room in the body budget before it is refused."""
CHUNK = 64 << 10
RATE_GRACE_S = 2.0
"""Seconds a body may take before the minimum upload rate applies."""
GRPC_READERS = 4
"""gRPC request messages being received at once (each holds twice the largest body until read)."""
GRPC_READERS_PER_TENANT = GRPC_READERS // 2
"""Of those, what one named tenant may hold (a gateway without keys: its one tenant, all of them): a
tenant that floods the gRPC API with messages it never finishes leaves the others room."""
FETCHED_COPIES = 2
"""Budget charged per fetched media byte: the bytes, and their base64 in an LM body."""

REFUSED = Counter("epd_gateway_bodies_refused_total", "Request bodies refused before admission", ["reason"])
HELD = Gauge("epd_gateway_body_bytes_held", "Budget held by request bodies (BODY_COPIES per byte)")
READING = Gauge("epd_gateway_bodies_reading", "Request bodies being read")
SLOW_READERS = Counter("epd_gateway_slow_readers_total", "Answers cut off because the client did not read them "
                       "in time (--answer-timeout-s, --answer-min-rate-kib), REST and gRPC")

_CODES = {408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


class BodyRefused(EPDError):
    """A body the gateway will not take: ``status`` 408, 413 or 503, with a message (the gRPC API's
    error boundary answers the matching code)."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.code = _CODES[status]
        REFUSED.labels(reason).inc()


class BodyLease:
    """A request's share of the body budget; ``release`` when its answer ends (idempotent)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.nbytes = 0

    async def grow(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if nbytes > self._budget.capacity or not await self._budget.acquire(nbytes, WAIT_S):
            raise BodyRefused(503, f"the gateway holds {self._budget.used >> 20} MiB of requests, its limit "
                                   "(--body-memory-mib); retry later", "memory")
        self.nbytes += nbytes
        HELD.inc(nbytes)

    async def resize(self, nbytes: int) -> None:
        """Holds exactly ``nbytes``: gives back what is over, takes what is missing."""
        if nbytes < self.nbytes:
            self._budget.release(self.nbytes - nbytes)
            HELD.dec(self.nbytes - nbytes)
            self.nbytes = nbytes
        else:
            await self.grow(nbytes - self.nbytes)

    def hold(self, nbytes: int) -> None:
        """Charges ``nbytes`` now, even past the budget's capacity: bytes the gateway already holds (an
        answer waiting to be sent) must be counted, not refused; requests that come next wait or are
        refused until they are gone."""
        if nbytes > 0:
            self._budget.force(nbytes)
            self.nbytes += nbytes
            HELD.inc(nbytes)

    def release(self) -> None:
        if self.nbytes:
            self._budget.release(self.nbytes)
            HELD.dec(self.nbytes)
            self.nbytes = 0


CURRENT_LEASE: contextvars.ContextVar[BodyLease | None] = contextvars.ContextVar("epd_body_lease", default=None)
"""The lease of the request the current task serves (set by the REST route and ``GrpcIntake``)."""


async def charge_fetched(nbytes: int) -> None:
    """Charges media a request fetched (http(s) URLs) to its lease. Raises BodyRefused (503)."""
    lease = CURRENT_LEASE.get()
    if lease is not None:
        await lease.grow(FETCHED_COPIES * nbytes)


class Intake:
    """The limits above, shared by the REST and gRPC front ends."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.max_body = cfg.max_body_bytes
        self.budget = ByteBudget(int(cfg.body_memory_mib * (1 << 20)), fifo=False)
        self.reading = 0
        self.grpc_reading = 0
        self._grpc_slots = asyncio.Semaphore(GRPC_READERS)
        self._grpc_by_tenant: collections.Counter[str] = collections.Counter()
        self.min_rate = cfg.body_min_rate_kib * 1024

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

    def _too_slow(self, got: int, elapsed: float) -> BodyRefused:
        return BodyRefused(408, f"the request body arrived too slowly ({got} bytes in {elapsed:.1f} s; at least "
                                f"{self.cfg.body_min_rate_kib:g} KiB/s after {RATE_GRACE_S:g} s, all of it within "
                                f"{self.cfg.body_timeout_s:g} s: --body-min-rate-kib, --body-timeout-s)", "timeout")

    async def read(self, request: web.Request) -> tuple[bytes, BodyLease]:
        """A REST request's body and its lease. Raises BodyRefused (nothing held then)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise self._too_large(declared)
        self.start_reading()
        lease, buf = BodyLease(self.budget), bytearray()
        try:
            start = time.monotonic()
            while True:
                try:
                    chunk = await asyncio.wait_for(request.content.read(CHUNK), 0.5)
                except asyncio.TimeoutError:
                    chunk = None  # nothing came for 0.5 s: judge the pace below
                if chunk:
                    # What else has arrived, before the pace is judged: an event loop that stalled
                    # while the body arrived is not the client's slowness.
                    while more := request.content.read_nowait(CHUNK):
                        chunk += more
                if chunk == b"":
                    break
                if chunk:
                    if len(buf) + len(chunk) > (declared if declared is not None else self.max_body):
                        raise self._too_large(len(buf) + len(chunk))
                    await lease.grow(len(chunk))  # what arrived, once: the buffer holds it
                    buf += chunk
                    if request.content.at_eof():
                        break
                elapsed = time.monotonic() - start
                if elapsed > self.cfg.body_timeout_s or (elapsed > RATE_GRACE_S and
                                                         len(buf) < self.min_rate * (elapsed - RATE_GRACE_S)):
                    raise self._too_slow(len(buf), elapsed)
            await lease.resize(BODY_COPIES * len(buf))  # all there: parsing and decoding make the copies
        except BaseException:
            lease.release()
            raise
        finally:
            self.done_reading()
        return bytes(buf), lease

    async def reserve_message(self, tenant: str = ANONYMOUS) -> BodyLease:
        """A gRPC call's lease for its one request message, before grpc reads it: a read slot and
        twice the largest body (the message as grpc holds it, and its deserialized copy); a named
        ``tenant`` gets at most ``GRPC_READERS_PER_TENANT`` slots at once (429 past it). Raises
        BodyRefused (nothing held then); ``done_grpc_reading(tenant)`` gives the slot back."""
        if tenant != ANONYMOUS and self._grpc_by_tenant[tenant] >= GRPC_READERS_PER_TENANT:
            raise BodyRefused(429, f"tenant {tenant} is sending {self._grpc_by_tenant[tenant]} gRPC request messages "
                                   "at once, its share; retry later", "tenant")
        self._grpc_by_tenant[tenant] += 1
        try:
            return await self._reserve_message()
        except BaseException:
            self._release_tenant(tenant)
            raise

    def _release_tenant(self, tenant: str) -> None:
        self._grpc_by_tenant[tenant] -= 1
        if self._grpc_by_tenant[tenant] <= 0:
            del self._grpc_by_tenant[tenant]

    async def _reserve_message(self) -> BodyLease:
        try:
            await asyncio.wait_for(self._grpc_slots.acquire(), WAIT_S)
        except asyncio.TimeoutError:
            raise BodyRefused(503, f"the gateway is receiving {self.grpc_reading} gRPC request messages, its limit; "
                                   "retry later", "readers") from None
        try:
            self.start_reading()
        except BodyRefused:
            self._grpc_slots.release()
            raise
        self.grpc_reading += 1
        lease = BodyLease(self.budget)
        try:
            await lease.grow(2 * self.max_body)
        except BaseException:
            self.done_grpc_reading()
            raise
        return lease

    def done_grpc_reading(self, tenant: str = ANONYMOUS) -> None:
        self._release_tenant(tenant)
        self.grpc_reading -= 1
        self._grpc_slots.release()
        self.done_reading()


def message_nbytes(request) -> int:
    """The size of a GatewayService request's payload (its body and media; protobuf's
    ``ByteSize`` walks the whole message, 0.1 s for 86 MB)."""
    if not hasattr(request, "media"):  # a ResponseRef: an id
        return request.ByteSize()
    return len(request.body) + sum(len(m) for m in request.media)


class GrpcIntake(grpc.aio.ServerInterceptor):
    """The intake limits on the gateway's native gRPC API (see the module docstring): each
    GatewayService call (one request message, a stream of answers) gets a request-streaming
    handler that takes a read slot and the body budget before grpc reads the message, reads it
    within ``--body-timeout-s``, and hands it to the servicer's own handler, writing each answer
    within the answer deadline (``--answer-timeout-s`` plus its size at ``--answer-min-rate-kib``;
    a client that does not read is cut off with DEADLINE_EXCEEDED, the servicer's call closed so the
    LM's work and the admission place go back); the lease is held until the call ends, and then the message's payload is dropped even if grpc keeps the
    message object (it does, with the call, until the call's state is collected)."""

    SERVICE = "/epd.gateway.v1.GatewayService/"

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.SERVICE) or handler.request_streaming \
                or not handler.response_streaming:
            return handler
        intake, inner = self.intake, handler.unary_stream
        cfg = intake.cfg

        async def call(request_iterator, context):
            # A coroutine that writes each answer itself (``context.write``), not a generator: a write
            # the client does not take in time is abandoned and the call ended, which a yield cannot do.
            status, request, lease = None, None, None
            tenant = CURRENT_TENANT.get()  # set by the auth interceptor, in this call's task
            try:
                lease = await intake.reserve_message(tenant)
                try:
                    request = await asyncio.wait_for(anext(aiter(request_iterator), None), intake.cfg.body_timeout_s)
                except asyncio.TimeoutError:
                    raise BodyRefused(408, "the request message did not arrive within "
                                           f"{intake.cfg.body_timeout_s:g} s (--body-timeout-s)", "timeout") from None
                finally:
                    intake.done_grpc_reading(tenant)
                if request is None:
                    raise BodyRefused(408, "no request message", "timeout")
                await lease.resize(BODY_COPIES * message_nbytes(request))
                CURRENT_LEASE.set(lease)
                answer = inner(request, context)
                try:
                    async for response in answer:
                        size = response.ByteSize()
                        limit = cfg.answer_timeout_s + size / (cfg.answer_min_rate_kib * 1024)
                        try:
                            async with asyncio.timeout(limit):
                                await context.write(response)
                        except TimeoutError:
                            SLOW_READERS.inc()
                            logger.info("gRPC call %s: the client did not read %d bytes of its answer within %.1f s; "
                                        "ending it", details.method, size, limit)
                            status = (grpc.StatusCode.DEADLINE_EXCEEDED, "the client did not read its answer in "
                                      "time (--answer-timeout-s, --answer-min-rate-kib)")
                            break
                finally:
                    await answer.aclose()  # the servicer's own finally: the LM call cancelled, places back
            except BodyRefused as e:
                status = (e.code, e.message)
            finally:
                if lease is not None:
                    lease.release()
                if request is not None:
                    request.Clear()  # the payload goes now, whoever still holds the message
            if status is not None:
                await context.abort(*status)

        return grpc.stream_stream_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)
