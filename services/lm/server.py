"""LM service wiring and lifecycle: consumer engine + LMService + health.

Stop (SIGTERM): drain first (``services.common.drain``: NOT_SERVING, then wait within ``--drain-grace-s``
until no call is in flight and the engine has no unfinished request, background responses included), then
stop gRPC and the engine (which frees its staging and shared memory). Its stored responses go with it: once
it has left, the gateway answers 404 for them, as vLLM answers for an id it does not hold.

vLLM is imported at the top: ``epd lm`` imports this module after ``configure_process_env``
(``services.cli.service_module``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from ectransfer import factory
from ectransfer.connector.cache_manager import EC_MANAGER_CONFIG
from ectransfer.connector.common import compat_for
from ectransfer.connector.config import ConnectorConfig, ConnectorTuning, ec_transfer_config
from ectransfer.shm import cleanup_orphans
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from peerauth import SecurityConfig
from services.common.drain import InFlight, drain
from services.common.engine import (
    ENCODER_DECODER_GAP,
    EngineConfig,
    UnsupportedModel,
    build_async_engine,
    configure_process_env,
    encoder_apart_verified,
    is_encoder_decoder,
    serve_until_stopped,
)
from services.common.grpc_server import GrpcServer
from services.common.media import MediaDecoder
from services.common.metrics_port import MetricsPort, exposure_for
from services.fleet_memory import holdings
from services.lm import media_connector
from services.lm.config import LMServiceConfig
from services.lm.frontend import build_frontend
from services.lm.handoff import kv_transfer_config
from services.lm.peers import EncoderAllowList, PeerChecker
from services.lm.response_store import StoredResponses
from services.lm.servicer import LMServicer
from services.lm.side_channel import SideChannelWatch

logger = logging.getLogger(__name__)


def _ec_config(cfg: LMServiceConfig, engine_cfg: EngineConfig, security: SecurityConfig,
               tuning: ConnectorTuning | None = None) -> dict:
    """The consumer's connector settings: the ``--connector-*`` knobs plus what this service's own flags say."""
    return ec_transfer_config("ec_consumer", ConnectorConfig(
        **(tuning or ConnectorTuning()).extra(), staging_bytes=int(cfg.staging_mib * (1 << 20)),
        transports=cfg.transport_list(), transfer_timeout_s=cfg.transfer_timeout_s, model_name=engine_cfg.model,
        security=security.to_dict()))


def ec_consumer(engine_cfg: EngineConfig) -> bool:
    """Whether this LM's engine is an EC consumer (takes encoder outputs over Transfer): every model but
    an encoder-decoder one where the encoder-apart path is not verified (``encoder_apart_verified``: vLLM by
    itself would decode it without the audio), which this LM then serves as a plain engine, encoding its
    audio itself (the encoder-decoder guard). Read at start, never per request."""
    return not is_encoder_decoder(engine_cfg) or encoder_apart_verified(engine_cfg)


def check(cfg: LMServiceConfig, security: SecurityConfig) -> EncoderAllowList:
    """Refuses (ValueError) a configuration before an engine start is spent on
    it (an unauthenticated non-loopback bind of the API or metrics port, a malformed allow-list); returns
    the allow-list. NIXL's side channel's bind rule is the config's own
    (``LMServiceConfig``: refused when it is made)."""
    security.require_for(cfg.host, f"the LM API ({cfg.host}:{cfg.port})")
    if cfg.metrics_port:
        exposure_for(cfg.metrics_host, security)
    return EncoderAllowList.parse(cfg.allowed_encoders, trusted_callers=security.authenticated)


def _engine(cfg: LMServiceConfig, engine_cfg: EngineConfig, security: SecurityConfig, tuning: ConnectorTuning | None,
            consumer: bool, published: holdings.Published | None):
    """The LM's vLLM engine: an EC consumer (for an encoder-decoder model, with our worker:
    ``ectransfer.connector.encoder_decoder``), or, where that model's path is not verified, a plain engine
    that encodes its own audio; with vLLM's KV cache events on when the holdings are ``published``."""
    events = published.engine_args() if published is not None else {}
    speech = is_encoder_decoder(engine_cfg)
    if speech and cfg.disaggregated:  # vLLM refuses a KV connector for an encoder-decoder model
        raise UnsupportedModel(f"{engine_cfg.model} is an encoder-decoder model: it cannot run as a {cfg.role} LM "
                               "(vLLM 0.32 takes no KV connector for one); run it with --role both")
    if consumer and speech:
        # The encoder-apart path (ectransfer.connector.encoder_decoder): our worker's runner hands the decoder the
        # transferred encoder outputs; vLLM's own encoder-decoder cache manager (the items carry their audio,
        # and vLLM allocates their cross-attention blocks as for a local encode).
        from vllm.platforms import current_platform

        from ectransfer.connector.encoder_decoder import WORKER_CLS

        return build_async_engine(engine_cfg, _ec_config(cfg, engine_cfg, security, tuning),
                                  worker_cls=WORKER_CLS["cpu" if current_platform.is_cpu() else "cuda"],
                                  **events, **cfg.engine_args())
    if consumer:
        # No processor cache: a prompt laid out from an encoder's metadata carries its
        # items without data, which vLLM's engine-side processor cache would take for
        # a cache entry it lost (MultiModalCacheMissError).
        kv = kv_transfer_config(cfg)
        return build_async_engine(engine_cfg, _ec_config(cfg, engine_cfg, security, tuning),
            ec_manager_config=EC_MANAGER_CONFIG, mm_processor_cache_gb=0, **({"kv_transfer_config": kv} if kv is not None else {}), **events,
            **cfg.engine_args())
    else:
        logger.warning("%s is an encoder-decoder model: this LM encodes its audio itself and takes no "
                       "encoder outputs (%s)", engine_cfg.model, ENCODER_DECODER_GAP)
        return build_async_engine(engine_cfg, None, **events, **cfg.engine_args())


async def serve(cfg: LMServiceConfig, engine_cfg: EngineConfig, stop: asyncio.Event | None = None,
                security: SecurityConfig | None = None, tuning: ConnectorTuning | None = None) -> None:
    """``security``: TLS and token for the API port, and what the LM presents to encoders' Transfer ports;
    ``tuning``: the connector's other knobs (``--connector-*``)."""
    stop = stop or asyncio.Event()
    security = security or SecurityConfig()
    allowed = check(cfg, security)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    configure_process_env()  # `epd` did before importing this module; for in-process callers (tests)

    media_connector.install()  # the LM never downloads; data: URLs load under the media limits
    # vLLM's speech-to-text serving decodes an upload itself (an encoder-decoder model's
    # /v1/audio routes): the same duration bound as the media connector's, unless the operator set one.
    os.environ.setdefault("VLLM_MAX_AUDIO_DECODE_DURATION_S", str(int(cfg.max_audio_seconds)))
    consumer = ec_consumer(engine_cfg)
    published = holdings.Published() if cfg.holdings else None  # what the prefix cache holds (fleet_memory)
    try:
        engine = _engine(cfg, engine_cfg, security, tuning, consumer, published)
    except BaseException:
        if published is not None:
            published.close()
        raise
    server = watch = metrics = None
    try:
        if published is not None:
            published.start()
        frontend = await build_frontend(engine, cfg, engine_cfg.model)
        compat = compat_for(engine.vllm_config, engine_cfg.model)
        # The service process checks compatibility and reachability; it never
        # opens a CUDA IPC handle itself (that would put a CUDA context in it):
        # the engine's connector negotiates for real and reports per request.
        names = factory.resolve(cfg.transport_list(), "consumer")
        transports = [factory.make_service_consumer(t) for t in names]
        consumer_id = engine.vllm_config.ec_transfer_config.engine_id if consumer else ""
        peers = PeerChecker(compat, consumer_id, transports,
                            cfg.handshake_timeout_s, security=security,
                            allowed=allowed)
        info = lm_pb2.LMInfo(model=frontend.models.model_name(), compat=compat, role=cfg.role)
        inflight = InFlight()
        server = GrpcServer(cfg.host, cfg.port, security, interceptors=[inflight])
        server.add(lm_pb2_grpc.add_LMServiceServicer_to_server,
                   LMServicer(engine, info, peers, frontend, MediaDecoder(cfg),
                              StoredResponses.of_app(frontend.app, cfg.responses_store_max,
                                                     int(cfg.responses_store_mib * (1 << 20))),
                              getattr(published, "holdings", None)),
                   lm_pb2.DESCRIPTOR.services_by_name["LMService"].full_name)
        port = await server.start()
        if cfg.metrics_port:
            metrics = MetricsPort(cfg.metrics_host, cfg.metrics_port, exposure_for(cfg.metrics_host, security))
            await metrics.start()
        await server.set_serving(True)
        if cfg.role == "prefill":
            # Decode LMs dial this LM's side channel (a decode LM's own is dialed by nobody: vLLM's
            # NixlConnector pulls). vLLM's listener is up once the engine is; without it, NOT_SERVING.
            watch = SideChannelWatch(cfg.kv_host, cfg.kv_port, on_dead=lambda _why: server.set_serving(False))
            watch.start()
        logger.info("lm ready: api %s:%d, model %s", cfg.host, port, engine_cfg.model)
        await serve_until_stopped(engine, server.set_serving, stop)  # EngineDied if the engine dies

        async def idle() -> bool:  # no call here, no request in the engine (a background one too)
            return not inflight.count and not engine.get_num_unfinished_requests()

        await drain(server.set_serving, idle, cfg.drain_grace_s, what="lm")
    finally:
        if watch is not None:
            await watch.stop()
        if server is not None:
            await server.stop()
        if metrics is not None:
            await metrics.stop()
        engine.shutdown()
        # The engine process may be gone before its connector's shutdown ran
        # (vLLM stops the executor first, and the client kills stragglers):
        # remove the segments it owned, now that its pid is dead.
        cleanup_orphans()
        if published is not None:
            published.close()
