"""Domain errors and the one place that maps them to gRPC status codes.

Handlers raise these; ``ErrorInterceptor`` turns them into statuses (bad input:
INVALID_ARGUMENT, no capacity: RESOURCE_EXHAUSTED, peer gone: UNAVAILABLE,
incompatible peer: FAILED_PRECONDITION, anything else: INTERNAL with the
traceback logged). An error caused by a peer names it in the ``epd-fault``
trailer (``epd.lm.v1.Fault``: written here, read by ``services.gateway.failures``
alone), which the gateway's retry logic reads.
"""

from __future__ import annotations

import logging
import secrets
import traceback

import grpc

from epd.lm.v1 import lm_pb2

logger = logging.getLogger(__name__)

FAULT_KEY = "epd-fault"
FAULT_ENDPOINT_KEY = "epd-fault-endpoint"  # one per failing encoder transfer endpoint


def fault_trailer(fault: int) -> tuple[str, str]:
    """The ``epd-fault`` trailer of a fault (``lm_pb2.FAULT_*``): ``FAULT_ENCODER`` -> "encoder"."""
    return FAULT_KEY, lm_pb2.Fault.Name(fault).removeprefix("FAULT_").lower()


def read_fault(trailers) -> int:
    """The fault a failed call's trailers name (``lm_pb2.FAULT_*``); ``FAULT_UNSPECIFIED`` when none, or
    one this version does not know."""
    for key, value in trailers:
        if key == FAULT_KEY and isinstance(value, str) and value.isalpha():
            try:
                return lm_pb2.Fault.Value("FAULT_" + value.upper())
            except ValueError:
                return lm_pb2.FAULT_UNSPECIFIED
    return lm_pb2.FAULT_UNSPECIFIED


class EPDError(Exception):
    code = grpc.StatusCode.INTERNAL
    fault: int = lm_pb2.FAULT_UNSPECIFIED
    """Which peer caused the error (``lm_pb2.FAULT_*``), sent as the ``epd-fault`` trailer when set,
    so the gateway knows which instance to replace on a retry."""
    endpoints: tuple[str, ...] = ()
    """The faulty peers' endpoints, one ``epd-fault-endpoint`` trailer each."""


class BadInput(EPDError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class MediaError(BadInput):
    """Refused media: an image URL that may not or could not be fetched, or image bytes that are too
    large, not an image, or a decompression bomb. Raised by the gateway's ``services.gateway.fetch`` and
    ``services.common.media_checks.check_image``; the REST API answers ``status`` (400, or 413 for too large)
    and the gRPC boundary INVALID_ARGUMENT. The message says what was refused and why."""

    def __init__(self, message: str, status: int = 400, modality: str = "image") -> None:
        super().__init__(message)
        self.status = status
        self.modality = modality  # of the refused item: "image", "audio" or "video"


class NoCapacity(EPDError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PeerUnavailable(EPDError):
    code = grpc.StatusCode.UNAVAILABLE


class EncoderUnavailable(PeerUnavailable):
    """The LM could not get an item's embedding from its encoder (dead, timed
    out, freed): the gateway re-encodes the item on another encoder.
    ``endpoints`` name the encoders' transfer endpoints, when known."""

    fault = lm_pb2.FAULT_ENCODER

    def __init__(self, message: str, endpoints: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoints = tuple(endpoints)


class PrefillKVUnavailable(PeerUnavailable):
    """A decode LM could not load the prompt's KV from the prefill LM that computed it (vLLM's NIXL
    handshake or read failed: the prefill LM is gone, unreachable, or let the blocks go when its lease
    ran out). Nothing was generated: the gateway runs the request again without that prefill LM."""

    fault = lm_pb2.FAULT_PREFILL


class Incompatible(EPDError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class RoleMismatch(EPDError):
    """A call in an E -> P -> D phase (``KVHandoff``) that this LM's role does not take: its caller (the
    gateway) routed by a role the LM no longer has (it was restarted with another ``--role`` at the same
    address before a health check saw it go). The ``epd-fault: role`` trailer tells the gateway to verify
    the LM again (its GetInfo names the new role) and retry the request elsewhere; nothing ran."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    fault = lm_pb2.FAULT_ROLE


class Forbidden(EPDError):
    """A request names a peer this service may not use (an encoder outside the LM's allow-list)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Deadline(EPDError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _status(e: BaseException, method: str, request=None) -> tuple:
    """The (code, details, trailers) a handler's exception ends its call with."""
    if isinstance(e, EPDError):
        trailers = [fault_trailer(e.fault)] if e.fault else []
        trailers += [(FAULT_ENDPOINT_KEY, ep) for ep in e.endpoints]
        return e.code, str(e), tuple(trailers)
    # The caller gets the request's id (or an error id), never the exception: its text can name
    # files, addresses or internal state. The log has the traceback under the same id.
    rid = getattr(request, "request_id", "") or f"error-{secrets.token_hex(6)}"
    logger.error("internal error in %s (request %s)", method, rid, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error in {method} (request {rid}; the service's log has the " \
                                     "details)", ()


def _forget(e: BaseException) -> None:
    """Drops what ``e`` keeps alive: its traceback's frames (a handler's locals: a request's body,
    its decoded media) and the exceptions chained to it. grpc keeps the exception that ended a
    call (``AbortError``) for the call's lifetime, and what hangs off it is freed only with it."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        nxt = e.__cause__ or e.__context__
        e.__cause__ = e.__context__ = None
        e = nxt


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors raised by unary and streaming handlers to statuses."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_stream:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                status = None
                try:
                    async for item in inner(request, context):
                        yield item
                except (grpc.aio.AbortError, GeneratorExit):
                    raise
                except Exception as e:  # noqa: BLE001 - the error boundary
                    status = _status(e, method, request)
                    _forget(e)
                # Aborted outside the except block, so the AbortError grpc keeps carries no chain.
                if status is not None:
                    await context.abort(*status)

            return handler._replace(unary_stream=unary_stream)
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                status = None
                try:
                    return await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:  # noqa: BLE001 - the error boundary
                    status = _status(e, method, request)
                    _forget(e)
                await context.abort(*status)

            return handler._replace(unary_unary=unary_unary)
        return handler
