"""The intake limits on the gateway's native gRPC API (``GrpcIntake``, an interceptor): each
GatewayService call takes a read slot and the body budget (``intake.Intake``) before grpc reads its one
request message, and writes each answer within the answer deadline. The lease it takes is handed to
the servicer's handler (``GRPC_LEASE``) and released when the call ends.

Owner: ``server.serve`` makes one, over the REST routes' ``Intake``."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import grpc

from services.gateway.auth import CURRENT_TENANT
from services.gateway.config import BODY_COPIES
from services.gateway.intake import SLOW_READERS, BodyLease, BodyRefused, Intake

logger = logging.getLogger(__name__)


GRPC_LEASE: contextvars.ContextVar[BodyLease | None] = contextvars.ContextVar("epd_grpc_lease", default=None)
"""A native gRPC call's lease, from ``GrpcIntake`` to the servicer's handler: grpc gives an interceptor no
other way to hand its handler a value (the tenant crosses the same way: ``auth.CURRENT_TENANT``). The
handler reads it once and passes it on explicitly (``RequestCore.admit(lease=...)``); nothing else reads it."""


def sized(deserializer):
    """``deserializer`` that also says how many bytes the message had on the wire: what the client
    delivered, known without reading the message again (protobuf's ``ByteSize`` walks the whole message,
    0.1 s for 86 MB, and each read of a ``bytes`` field copies it)."""
    def deserialize(raw: bytes):
        return len(raw), (deserializer(raw) if deserializer is not None else raw)
    return deserialize


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
            peer = context.peer() or ""  # one connection: its address and port
            try:
                lease = await intake.reserve_message(tenant, peer)
                try:
                    message = await asyncio.wait_for(anext(aiter(request_iterator), None), intake.cfg.body_timeout_s)
                except asyncio.TimeoutError:
                    raise BodyRefused(408, "the request message did not arrive within "
                                           f"{intake.cfg.body_timeout_s:g} s (--body-timeout-s)", "timeout") from None
                finally:
                    intake.done_grpc_reading(tenant, peer)
                if message is None:
                    raise BodyRefused(408, "no request message", "timeout")
                nbytes, request = message
                await lease.resize(BODY_COPIES * nbytes)
                GRPC_LEASE.set(lease)
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

        return grpc.stream_stream_rpc_method_handler(call, request_deserializer=sized(handler.request_deserializer),
                                                     response_serializer=handler.response_serializer)
