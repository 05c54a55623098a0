"""Domain errors and the one place that maps them to gRPC status codes.

Handlers raise these; ``ErrorInterceptor`` turns them into statuses (bad input:
INVALID_ARGUMENT, no capacity: RESOURCE_EXHAUSTED, peer gone: UNAVAILABLE,
incompatible peer: FAILED_PRECONDITION, anything else: INTERNAL with the
traceback logged).
"""

from __future__ import annotations

import logging

import grpc

logger = logging.getLogger(__name__)


class EPDError(Exception):
    code = grpc.StatusCode.INTERNAL


class BadInput(EPDError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NoCapacity(EPDError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PeerUnavailable(EPDError):
    code = grpc.StatusCode.UNAVAILABLE


class Incompatible(EPDError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Deadline(EPDError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


async def _abort(context, e: BaseException, method: str):
    if isinstance(e, EPDError):
        await context.abort(e.code, str(e))
    logger.exception("internal error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")


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
                try:
                    async for item in inner(request, context):
                        yield item
                except (grpc.aio.AbortError, GeneratorExit):
                    raise
                except Exception as e:  # noqa: BLE001 - the error boundary
                    await _abort(context, e, method)

            return handler._replace(unary_stream=unary_stream)
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:  # noqa: BLE001 - the error boundary
                    await _abort(context, e, method)

            return handler._replace(unary_unary=unary_unary)
        return handler
