"""Encoder service wiring and lifecycle.

Start: build the producer engine (its connector binds the Transfer server in
the engine process and writes the bound endpoint to a file), then serve
EncoderService + health + reflection. Stop: NOT_SERVING, stop gRPC, then shut
the engine down (which stops the Transfer server and frees the pool).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import time

from ectransfer.connector.common import compat_for
from ectransfer.security import SecurityConfig
from ectransfer.shm import cleanup_orphans
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from services.common.engine import EngineConfig, build_async_engine, serve_until_stopped
from services.common.grpc_server import GrpcServer
from services.common.media import ImageDecoder
from services.encoder.config import EncoderServiceConfig
from services.encoder.servicer import EncoderServicer, dtype_enum

logger = logging.getLogger(__name__)


def _ec_config(cfg: EncoderServiceConfig, engine_cfg: EngineConfig, endpoint_file: str,
               security: SecurityConfig) -> dict:
    return {
        "ec_connector": "EPDConnector",
        "ec_connector_module_path": "ectransfer.connector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {
            "transfer_host": cfg.transfer_host,
            "advertise_host": cfg.advertise_host,
            "transfer_port": cfg.transfer_port,
            "endpoint_file": endpoint_file,
            "outbound_pool_bytes": int(cfg.outbound_pool_mib * (1 << 20)),
            "transports": [t for t in cfg.transports.split(",") if t],
            "lease_s": cfg.lease_s,
            "model_name": engine_cfg.model,
            "security": security.to_dict(),
        },
    }


def _placeholder(engine) -> str:
    from vllm.model_executor.models.registry import ModelRegistry

    mc = engine.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    ph = model_cls.get_placeholder_str("image", 1)
    if not ph:
        raise ValueError(f"{mc.architectures} declares no image placeholder")
    return ph


def check(cfg: EncoderServiceConfig, security: SecurityConfig) -> None:
    """Refuses (ValueError) a configuration before an engine start is spent on
    it: an unauthenticated non-loopback bind."""
    security.require_for(cfg.host, f"the encoder API ({cfg.host}:{cfg.port})")
    security.require_for(cfg.transfer_host, f"the Transfer server ({cfg.transfer_host})")


async def serve(cfg: EncoderServiceConfig, engine_cfg: EngineConfig, stop: asyncio.Event | None = None,
                security: SecurityConfig | None = None) -> None:
    """``security``: TLS and token for the API port and the engine's Transfer server."""
    stop = stop or asyncio.Event()
    security = security or SecurityConfig()
    check(cfg, security)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # The engine writes its Transfer endpoint here: a 0700 directory of our own
    # (mkdtemp), so no other user can plant a file under the name first.
    private_dir = tempfile.mkdtemp(prefix="epd-encoder-")
    endpoint_file = os.path.join(private_dir, "transfer.endpoint")
    engine = build_async_engine(engine_cfg, _ec_config(cfg, engine_cfg, endpoint_file, security))
    server = None
    decoder = ImageDecoder(cfg)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(endpoint_file):  # noqa: ASYNC240 - a stat every 50 ms at start-up
            if time.monotonic() > deadline:
                raise RuntimeError("the engine's transfer server did not report its endpoint")
            await asyncio.sleep(0.05)
        with open(endpoint_file) as f:  # noqa: ASYNC230 - a few bytes on a private tmpfs file, once
            transfer_endpoint = f.read().strip()
        os.unlink(endpoint_file)
        mc = engine.model_config
        info = encoder_pb2.EncoderInfo(
            encoder_id=engine.vllm_config.ec_transfer_config.engine_id,
            transfer_endpoint=transfer_endpoint,
            compat=compat_for(engine.vllm_config, engine_cfg.model),
        )
        servicer = EncoderServicer(engine, info, _placeholder(engine), mc.get_hidden_size(),
                                   dtype_enum(str(mc.dtype).removeprefix("torch.")), cfg.encode_timeout_s,
                                   decoder)
        server = GrpcServer(cfg.host, cfg.port, security)
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer,
                   encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name)
        port = await server.start()
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port, addr=cfg.host)
        await server.set_serving(True)
        logger.info("encoder ready: api %s:%d, transfer %s, model %s", cfg.host, port, transfer_endpoint,
                    engine_cfg.model)
        await serve_until_stopped(engine, server.set_serving, stop)  # EngineDied if the engine dies
    finally:
        if server is not None:
            await server.stop()
        engine.shutdown()
        decoder.close()
        # The engine process may be gone before its connector's shutdown ran
        # (vLLM stops the executor first, and the client kills stragglers):
        # remove the segments it owned, now that its pid is dead.
        cleanup_orphans()
        shutil.rmtree(private_dir, ignore_errors=True)
