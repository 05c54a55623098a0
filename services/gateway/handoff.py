"""The gateway's half of an E -> P -> D request (the LM's half is ``services.lm.handoff``): the PREFILL
call to a prefill LM, which computes the prompt's KV and hands back its ``kv_transfer_params``; the
DECODE request for a decode LM, which loads that KV and generates; and the RELEASE of a hand-off no
decode LM took. The only gateway module that reads or writes a request's ``kv`` (``KVHandoff``).

Owner: the ``Orchestrator`` makes one ``Releases``; it holds the RELEASE calls in flight (bounded;
``close`` cancels them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import grpc

from epd.lm.v1 import lm_pb2
from services.gateway.encoding import EncodeGroup
from services.gateway.failures import Failure, rpc_error
from services.gateway.instances import Instance
from services.gateway.lm_call import call_lm
from services.gateway.values import Timings

logger = logging.getLogger(__name__)

MAX_PENDING_RELEASES = 1024
"""RELEASE calls in flight at most (``Releases.release``); past that, leases free the blocks."""
RELEASE_TIMEOUT_S = 10.0


def clear(req: lm_pb2.GenerateRequest) -> None:
    """A request as each attempt starts it: no hand-off yet."""
    req.ClearField("kv")


def decode_request(req: lm_pb2.GenerateRequest, params: bytes) -> lm_pb2.GenerateRequest:
    """The DECODE call of an E -> P -> D request: the same request (the decode LM renders the same
    prompt), the prefill LM's kv_transfer_params, and each item under the decode LM's own claim (the
    encoder's second one: it reads an item only if its recompute of the prompt's last token needs it)."""
    d_req = lm_pb2.GenerateRequest()
    d_req.CopyFrom(req)
    d_req.kv.phase = lm_pb2.KVHandoff.DECODE
    d_req.kv.params = params
    for item in d_req.items:
        if item.HasField("source") and item.source.extra_claims:
            item.source.claim = item.source.extra_claims[0]
            del item.source.extra_claims[:]
    return d_req


async def prefill(lm: Instance, req: lm_pb2.GenerateRequest, groups: Sequence[EncodeGroup], timings: Timings,
                  deadline: float, handoff: dict[str, bytes]) -> bytes | list[lm_pb2.GenerateResponse]:
    """The PREFILL call of an E -> P -> D request: the prefill LM computes the prompt's KV and keeps its
    blocks for a decode LM. Returns its kv_transfer_params, or, when it refused the request (vLLM's
    validation: the same answer the decode LM would give), its whole answer for the client.
    ``handoff["params"]``: the params as soon as they arrive (a cancel after that releases them)."""
    p_req = lm_pb2.GenerateRequest()
    p_req.CopyFrom(req)
    p_req.kv.phase = lm_pb2.KVHandoff.PREFILL
    answer: list[lm_pb2.GenerateResponse] = []
    started = time.perf_counter()
    async with contextlib.aclosing(call_lm(lm, p_req, groups, timings, deadline, final=False)) as stream:
        async for resp in stream:
            if resp.kv_transfer_params:
                handoff["params"] = resp.kv_transfer_params
            answer.append(resp)
    timings.prefill_ms = (time.perf_counter() - started) * 1e3
    status = answer[0].http_status if answer else 0
    if status != 200:
        return answer
    params = answer[-1].kv_transfer_params
    if not params:
        raise Failure(rpc_error(grpc.StatusCode.INTERNAL, f"prefill LM {lm.address} handed over no KV "
                                                          "(no kv_transfer_params)"), "lm", [lm])
    return params


class Releases:
    """RELEASE calls for hand-offs no decode LM took, in the background and bounded."""

    def __init__(self) -> None:
        self._releasing: set[asyncio.Task] = set()

    def release(self, decode: Instance, rid: str, params: bytes) -> None:
        """Asks ``decode`` (a RELEASE call, in the background, bounded) to tell the prefill LM named in
        ``params`` to let the prompt's blocks go. Best effort: where it cannot (too many pending, the decode
        LM gone), the prefill LM's lease (``--kv-lease-s``) frees them."""
        if len(self._releasing) >= MAX_PENDING_RELEASES:
            logger.warning("request %s: %d KV releases pending; the prefill LM's lease frees its blocks",
                           rid, len(self._releasing))
            return
        req = lm_pb2.GenerateRequest(request_id=rid)
        req.kv.phase, req.kv.params = lm_pb2.KVHandoff.RELEASE, params

        async def release() -> None:
            try:
                async for _ in decode.stub.Generate(req, timeout=RELEASE_TIMEOUT_S):
                    pass
            except grpc.aio.AioRpcError as e:
                logger.info("request %s: decode LM %s could not release the prefill LM's blocks (%s: %s); "
                            "its lease frees them", rid, decode.address, e.code().name, e.details())

        task = asyncio.get_running_loop().create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        for task in self._releasing:
            task.cancel()
        await asyncio.gather(*self._releasing, return_exceptions=True)
