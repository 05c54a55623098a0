"""Encoder service wiring and lifecycle.

Start: reserve the Transfer port (``reserve_port``), build the producer engine
(its connector binds the Transfer server on that port in the engine process),
then serve EncoderService + health + reflection. Stop (SIGTERM): drain first
(``services.common.drain``: NOT_SERVING, then wait within ``--drain-grace-s`` until
no Encode is in flight and every output in the outbound pool was read and acked
by its LM), then stop gRPC and shut the engine down (which stops the Transfer
server and frees the pool, the host tier's kept outputs with it).

vLLM is imported at the top: ``epd encoder`` imports this module after ``configure_process_env``
(``services.cli.service_module``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

import grpc

from ectransfer.connector.cache_manager import EC_MANAGER_CONFIG
from ectransfer.connector.common import compat_for
from ectransfer.connector.config import ConnectorConfig, ConnectorTuning, ec_transfer_config
from ectransfer.shm import cleanup_orphans
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from peerauth import SecurityConfig
from services.common.drain import InFlight, drain
from services.common.engine import (
    EngineConfig,
    build_async_engine,
    configure_process_env,
    placeholder_metadata_fields,
    refuse_encoder_decoder,
    serve_until_stopped,
)
from services.common.grpc_server import GrpcServer
from services.common.media import MediaDecoder
from services.common.metrics_port import MetricsPort, exposure_for
from services.common.protocol import ENCODER_PROTOCOL
from services.encoder.config import EncoderServiceConfig
from services.encoder.servicer import EncoderServicer, dtype_enum
from services.encoder.speech import SpeechWindows
from services.encoder.vllm_glue import layouts_context_free, placeholders

logger = logging.getLogger(__name__)


def _ec_config(cfg: EncoderServiceConfig, engine_cfg: EngineConfig, transfer_port: int,
               security: SecurityConfig, tuning: ConnectorTuning | None = None) -> dict:
    """The producer's connector settings: the ``--connector-*`` knobs plus what this service's own flags say."""
    return ec_transfer_config("ec_producer", ConnectorConfig(
        **(tuning or ConnectorTuning()).extra(), transfer_host=cfg.transfer_host, advertise_host=cfg.advertise_host,
        transfer_port=transfer_port, outbound_pool_bytes=int(cfg.outbound_pool_mib * (1 << 20)),
        host_tier_bytes=cfg.host_tier_bytes(),
        transports=cfg.transport_list(), lease_s=cfg.lease_s, model_name=engine_cfg.model,
        security=security.to_dict()))


def _own_transfer(cfg: EncoderServiceConfig, port: int, security: SecurityConfig):
    """A channel to this encoder's own Transfer server (in its engine process, which owns the outbound
    store) and its endpoint: dialled at the address it binds (loopback for a wildcard), not the
    advertised one, which may be reachable only from outside (NAT); with TLS the certificate is checked
    against the advertised name, as an LM checks it. The caller closes the channel."""
    wildcard = ("", "0.0.0.0", "::", "[::]")
    host = cfg.transfer_host if cfg.transfer_host not in wildcard else "127.0.0.1"
    endpoint = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    name = cfg.advertise_host or cfg.transfer_host
    options = [("grpc.ssl_target_name_override", name)] if security.tls and name not in (host, *wildcard) else None
    return security.aio_channel(endpoint, options), endpoint


async def _output_widths(transfer: transfer_pb2_grpc.TransferServiceStub, endpoint: str) -> dict[str, int]:
    """Per modality, the encoder output width the engine measured at start (vLLM's
    ``mm_encoder_output_widths``; Qwen3-VL's DeepStack rows are wider than the LM's hidden
    size), read from the engine's Transfer server: the engine process measured it, this one
    cannot see its config. Raises RuntimeError when the engine's server does not answer."""
    try:
        reply = await transfer.Stats(transfer_pb2.StatsRequest(), timeout=30)
    except grpc.aio.AioRpcError as e:
        raise RuntimeError(f"the engine's Transfer server at {endpoint} did not answer ({e.code().name}: "
                           f"{e.details()})") from None
    logger.info("encoder output widths (measured by the engine): %s", dict(reply.encoder_output_widths) or "none")
    return dict(reply.encoder_output_widths)


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound (not listening) to ``host:port`` with SO_REUSEPORT; port 0
    picks a free one. It holds the port for the engine's Transfer server, which vLLM
    builds in its EngineCore process, where the service cannot read the port back:
    told the port up front, the engine binds it too (gRPC servers set SO_REUSEPORT,
    and the kernel lets only the same user share the port), so the service knows its
    endpoint before the engine starts, and no other program can take the port in the
    seconds the engine takes to start. A socket that does not listen receives no
    connections. The caller closes it once the engine is up (the server listens
    then). A fixed port is first bound without SO_REUSEPORT, so one that any socket
    holds (another encoder's Transfer server too) is refused with OSError instead of
    being shared; bind(0) picks a port nobody holds."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    if port:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(addr)  # OSError (EADDRINUSE) when the port is in use
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def check(cfg: EncoderServiceConfig, security: SecurityConfig) -> None:
    """Refuses (ValueError) a configuration before an engine start is spent on
    it: an unauthenticated non-loopback bind (the metrics port's too)."""
    security.require_for(cfg.host, f"the encoder API ({cfg.host}:{cfg.port})")
    security.require_for(cfg.transfer_host, f"the Transfer server ({cfg.transfer_host})")
    if cfg.metrics_port:
        exposure_for(cfg.metrics_host, security)


def _idle(inflight: InFlight, transfer: transfer_pb2_grpc.TransferServiceStub):
    """The drain's check: no Encode in flight here, and no output in the engine's outbound pool that an
    LM has yet to read (``items_held``: held for a claim or a reader; the host tier's kept copies are not
    counted, they go with the engine) or that is reserved and not written yet."""
    async def idle() -> bool:
        if inflight.count:
            return False
        try:
            values = (await transfer.Stats(transfer_pb2.StatsRequest(), timeout=5)).values
        except grpc.aio.AioRpcError:
            return False
        return not values.get("items_held", 0) and not values.get("pending_reservations", 0)
    return idle


async def serve(cfg: EncoderServiceConfig, engine_cfg: EngineConfig, stop: asyncio.Event | None = None,
                security: SecurityConfig | None = None, tuning: ConnectorTuning | None = None) -> None:
    """``security``: TLS and token for the API port and the engine's Transfer server;
    ``tuning``: the connector's other knobs (``--connector-*``)."""
    stop = stop or asyncio.Event()
    security = security or SecurityConfig()
    check(cfg, security)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    configure_process_env()  # `epd` did before importing this module; for in-process callers (tests)

    refuse_encoder_decoder(engine_cfg, "encoder service (no LM could use its outputs)")
    # An encoder-decoder model's uploads are decoded here too (services.encoder.speech), by vLLM's rule
    # and under the bound the LM gives vLLM's speech-to-text serving: the same flag, unless the operator
    # set vLLM's variable.
    os.environ.setdefault("VLLM_MAX_AUDIO_DECODE_DURATION_S", str(int(cfg.max_audio_seconds)))

    try:
        reserved = reserve_port(cfg.transfer_host, cfg.transfer_port)
    except OSError as e:
        raise RuntimeError(f"cannot bind the Transfer port {cfg.transfer_host}:{cfg.transfer_port}: {e}") from None
    try:
        transfer_port = reserved.getsockname()[1]
        # A family whose items the LM needs processed metadata for (Qwen-VL's grid) must see every
        # item's processed data in Encode: vLLM's processor cache hands back none for items it
        # cached, so it is off for those families (the vision run is still shared).
        fixed = {"mm_processor_cache_gb": 0} if placeholder_metadata_fields(engine_cfg) else {}
        # Our encoder cache manager: an item served from the outbound store (the host tier) is an
        # "external load" vLLM allocates room for but never writes here (cache_manager.py).
        engine = build_async_engine(engine_cfg, _ec_config(cfg, engine_cfg, transfer_port, security, tuning),
                                    ec_manager_config=EC_MANAGER_CONFIG, **fixed)
    finally:
        reserved.close()  # the engine's Transfer server listens on the port now (or the engine failed)
    transfer_endpoint = f"{cfg.advertise_host or cfg.transfer_host}:{transfer_port}"
    server = channel = metrics = None
    decoder = MediaDecoder(cfg)
    try:
        mc = engine.model_config
        info = encoder_pb2.EncoderInfo(
            encoder_id=engine.vllm_config.ec_transfer_config.engine_id,
            transfer_endpoint=transfer_endpoint,
            compat=compat_for(engine.vllm_config, engine_cfg.model),
            protocol=ENCODER_PROTOCOL,
            speech_windows=mc.is_encoder_decoder,  # refused above where that path is not verified
        )
        channel, own_endpoint = _own_transfer(cfg, transfer_port, security)
        transfer = transfer_pb2_grpc.TransferServiceStub(channel)
        widths = await _output_widths(transfer, own_endpoint)
        servicer = EncoderServicer(engine, info, placeholders(engine), {"": mc.get_hidden_size(), **widths},
                                   dtype_enum(str(mc.dtype).removeprefix("torch.")), cfg.encode_timeout_s,
                                   decoder, layouts=layouts_context_free(engine), transfer=transfer,
                                   speech=SpeechWindows(mc) if mc.is_encoder_decoder else None)
        inflight = InFlight()
        server = GrpcServer(cfg.host, cfg.port, security, interceptors=[inflight])
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer,
                   encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name)
        port = await server.start()
        if cfg.metrics_port:
            metrics = MetricsPort(cfg.metrics_host, cfg.metrics_port, exposure_for(cfg.metrics_host, security))
            await metrics.start()
        await server.set_serving(True)
        logger.info("encoder ready: api %s:%d, transfer %s, model %s", cfg.host, port, transfer_endpoint,
                    engine_cfg.model)
        await serve_until_stopped(engine, server.set_serving, stop)  # EngineDied if the engine dies
        await drain(server.set_serving, _idle(inflight, transfer), cfg.drain_grace_s, what="encoder")
    finally:
        if server is not None:
            await server.stop()
        if metrics is not None:
            await metrics.stop()
        if channel is not None:
            await channel.close()
        engine.shutdown()
        decoder.close()
        # The engine process may be gone before its connector's shutdown ran
        # (vLLM stops the executor first, and the client kills stragglers):
        # remove the segments it owned, now that its pid is dead.
        cleanup_orphans()
