"""Gateway wiring and lifecycle: aiohttp (OpenAI REST, /metrics) and the
native gRPC API on one event loop."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_server import GrpcServer
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher
from services.gateway.openai_api import OpenAIRoutes, request_context
from services.gateway.orchestrator import Orchestrator
from services.gateway.servicer import GatewayServicer

logger = logging.getLogger(__name__)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(cfg: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    orch = Orchestrator(cfg)
    fetcher = MediaFetcher(cfg)  # http(s) image URLs; closed below, after the listeners stop
    runner = grpc_server = None
    try:  # everything set up so far is torn down on the way out, also after a failed start
        await orch.start()  # resolves names, checks every instance once, then keeps checking
        model = cfg.model_name or await orch.model_name()
        app = web.Application(middlewares=[request_context], client_max_size=cfg.max_image_bytes * 2 + (1 << 20))
        OpenAIRoutes(cfg, orch, model, fetcher=fetcher).add_to(app)
        app.router.add_get("/metrics", _metrics)
        # handler_cancellation: a client that disconnects cancels its handler, which
        # cancels the LM call (and with it the engine request).
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        if cfg.grpc_port:
            grpc_server = GrpcServer(cfg.host, cfg.grpc_port)
            grpc_server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server,
                            GatewayServicer(cfg, orch, fetcher=fetcher),
                            gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name)
            await grpc_server.start()
            await grpc_server.set_serving(True)
        logger.info("gateway ready: http://%s:%d/v1 (model %s, %d encoder(s), %d LM(s))",
                    cfg.host, cfg.port, model, len(cfg.encoder_list), len(cfg.lm_list))
        await stop.wait()
    finally:
        if grpc_server is not None:
            await grpc_server.stop()
        if runner is not None:
            await runner.cleanup()
        await fetcher.close()
        await orch.close()
