"""An encoder or LM that leaves without losing a request: it stops taking new work, finishes what it
holds within a grace period, then stops (docs/design.md, "Leave and join").

``InFlight`` is a gRPC server interceptor that counts the calls of the service's own API in flight (never
the health checks, reflection, ``GetInfo`` or ``Holdings``, which are no work a caller waits on). ``drain``
is what a service's SIGTERM starts: health NOT_SERVING (the gateway's instance checks then move the
instance to DRAINING: no new work is routed to it, calls in flight go on), ``epd_instance_draining`` 1,
then a wait until the service says it is idle (``idle``: its calls in flight, and what its engine and pool
still hold) at least ``quiet_s`` after NOT_SERVING (a call a gateway routed just before it saw NOT_SERVING
has arrived by then), or until ``grace_s`` passes. The caller then stops its server and engine in the usual
order, which frees what the instance holds (its outbound pool, host tier, staging and shared memory).

Owner: each service's ``serve`` makes one ``InFlight`` and runs ``drain`` once, on its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.signals import DRAINING

logger = logging.getLogger(__name__)

QUIET_S = 2.0
"""How long an instance must stay idle before it leaves: two of the gateway's health intervals (1 s by
default), after which no gateway still routes to it (a call routed just before the gateway saw NOT_SERVING
arrives within that)."""

_NOT_WORK = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/GetInfo", "/Holdings")


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the service's own calls in flight (``count``); handlers of every kind are counted from their
    first to their last message (a stream until it ends or is cancelled)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def _one(self):
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or any(method.startswith(p) or method.endswith(p) for p in _NOT_WORK):
            return handler
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                with self._one():
                    return await inner_uu(request, context)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                with self._one():
                    async for item in inner_us(request, context):
                        yield item

            return handler._replace(unary_stream=unary_stream)
        return handler  # no client-streaming calls on the encoder's or the LM's API


async def drain(set_serving: Callable[[bool], Awaitable[None]], idle: Callable[[], Awaitable[bool]],
                grace_s: float, quiet_s: float = QUIET_S, poll_s: float = 0.2, what: str = "instance") -> bool:
    """Drains this instance (module docstring); True when it became idle within ``grace_s``, False when
    the grace ran out first (what is still in flight is then cut by the caller's stop). ``idle`` must not
    raise (a check that cannot tell returns False)."""
    await set_serving(False)
    DRAINING.set(1)
    t0 = time.monotonic()
    deadline = t0 + max(0.0, grace_s)
    logger.info("%s draining: no new work; finishing what it holds (grace %.0f s)", what, grace_s)
    while True:
        now = time.monotonic()
        # Idle, and quiet_s since NOT_SERVING: a call a gateway routed before it saw that has arrived by then.
        if now - t0 >= min(quiet_s, grace_s) and await idle():
            logger.info("%s drained in %.1f s", what, now - t0)
            return True
        if now >= deadline:
            logger.warning("%s: drain grace of %.0f s ran out with work still in flight; stopping anyway",
                           what, grace_s)
            return False
        await asyncio.sleep(poll_s)
