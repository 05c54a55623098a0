"""A stub LM service for the gateway benchmark: the real LMService protocol,
no engine.

``Generate`` streams ``max_tokens`` GenerateResponse messages as fast as
grpc.aio sends them (one token each; the last has finish_reason "length",
usage and timings set), so ``bench/gateway.py`` measures the gateway's own
cost and not vLLM's scheduling noise. ``GetInfo`` answers model "stub-lm".
The server is the services' own ``GrpcServer`` (grpc.health.v1 with "" and the
service name SERVING, reflection, the error interceptor), so the gateway and a
direct client see what they would see from ``epd lm``.

    python bench/stub_lm.py --port 50099
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epd.common.v1 import common_pb2
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.common.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

MODEL = "stub-lm"
DEFAULT_MAX_TOKENS = 16


class StubLM(lm_pb2_grpc.LMServiceServicer):
    """Answers every Generate with ``max_tokens`` one-token messages, no waiting."""

    async def GetInfo(self, request, context):
        return lm_pb2.LMInfo(model=MODEL, compat=common_pb2.CompatInfo(model=MODEL))

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        n = request.sampling.max_tokens or DEFAULT_MAX_TOKENS
        # A fixed prompt length: the stub does not tokenize, and the gateway does not care.
        for i in range(n - 1):
            yield lm_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1000 + i % 1000], text=" tok")
        yield lm_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=[1000 + (n - 1) % 1000], text=" tok", finish_reason="length",
            usage=lm_pb2.Usage(prompt_tokens=16, completion_tokens=n),
            timings=lm_pb2.Timings(transfer_ms=0.0, ttft_ms=(time.perf_counter() - t0) * 1e3))


async def serve(host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = GrpcServer(host, port)
    server.add(lm_pb2_grpc.add_LMServiceServicer_to_server, StubLM(), "epd.lm.v1.LMService")
    bound = await server.start()
    await server.set_serving(True)
    logger.info("stub lm ready: %s:%d", host, bound)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
