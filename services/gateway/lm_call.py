"""One call of an LM's ``Generate``: its responses, the request's facts from its last message, and its
failure as the attempt's (``failures.lm_failure``). An encode that fails after its metadata stops the
call (the LM would wait for an embedding that never comes) unless tokens already flow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from epd.lm.v1 import lm_pb2
from services.gateway.encoding import EncodeGroup
from services.gateway.failures import Failure, lm_failure
from services.gateway.instances import Instance
from services.gateway.values import Timings


async def call_lm(lm: Instance, req: lm_pb2.GenerateRequest, groups: Sequence[EncodeGroup], timings: Timings,
                  deadline: float, final: bool = True,
                  prefill: Instance | None = None) -> AsyncIterator[lm_pb2.GenerateResponse]:
    """One LM call's responses. ``final``: its answer goes to the client (a PREFILL call's does not:
    its facts are not the request's). ``prefill``: a DECODE call's prefill LM, blamed when the decode
    LM could not load the KV from it (``FAULT_PREFILL``)."""
    first_at = 0.0
    stopped: BaseException | None = None  # the encode failure that stopped this call
    with lm.track():
        call_ms = timings.since_start_ms()
        call = lm.stub.Generate(req, timeout=max(0.001, deadline - time.monotonic()))

        def on_encode_done(task: asyncio.Task) -> None:
            # An encode that fails after its metadata leaves the LM waiting for an
            # embedding that will never come: stop it, unless tokens already flow.
            nonlocal stopped
            if not first_at and stopped is None and not task.cancelled() and task.exception() is not None:
                stopped = task.exception()
                call.cancel()

        for g in groups:
            g.task.add_done_callback(on_encode_done)
        try:
            async for resp in call:
                # The LM's first message comes with the first token (or is the whole answer):
                # from then on the encodes are moot and no failure is retried.
                first_at = first_at or time.perf_counter()
                if final and resp.HasField("timings"):  # the last message: the request's facts
                    timings.ttft_ms = call_ms + resp.timings.ttft_ms
                    timings.tpot_ms = resp.timings.tpot_ms
                    timings.transfer_ms = resp.timings.transfer_ms
                    timings.lm_queue_ms = resp.timings.lm_queue_ms
                    timings.transports = list(resp.transports)
                yield resp
        except asyncio.CancelledError:
            # Only our own cancel (an encode failed) becomes a retryable failure;
            # the caller's cancellation (client gone) stays a cancellation.
            if isinstance(stopped, Failure):
                raise stopped from None
            raise
        except grpc.aio.AioRpcError as e:
            # A PREFILL call (not final) or a DECODE call (its prefill LM named) is a hand-off call.
            raise lm_failure(e, lm, req, groups, prefill, handoff_call=not final or prefill is not None) from None
        finally:
            call.cancel()
