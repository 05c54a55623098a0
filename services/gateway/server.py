"""Gateway wiring and lifecycle: aiohttp (OpenAI REST, the public /metrics), the
native gRPC API and the internal metrics port (``--metrics-port``) on one event loop.
With ``--workers N`` (N > 1) ``serve`` supervises N such processes instead (``workers``)."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import signal
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from peerauth import SecurityConfig
from services.common.grpc_server import GrpcServer
from services.common.metrics_port import Exposure, MetricsPort, exposure_for
from services.gateway import metrics, objectives, workers
from services.gateway.auth import GrpcAuth
from services.gateway.auth import middleware as authenticate
from services.gateway.config import GatewayConfig
from services.gateway.core import RequestCore
from services.gateway.fetch import MediaFetcher
from services.gateway.grpc_intake import GrpcIntake
from services.gateway.intake import Intake
from services.gateway.openai_api import OpenAIRoutes, request_context
from services.gateway.orchestrator import Orchestrator
from services.gateway.parse_pool import ParsePool
from services.gateway.responses import ResponseIds
from services.gateway.servicer import GatewayServicer
from services.gateway.state.wiring import open_for
from services.gateway.tenants import Tenants
from services.gateway.workers import WorkerSeat

logger = logging.getLogger(__name__)

PUBLIC_STREAMS_PER_CONNECTION = 100
"""Concurrent calls one connection may make on the native gRPC API (HTTP/2 streams)."""


def bound_allocator() -> None:
    """glibc: allocations of 256 KiB and more are mmap'ed and given back to the system when freed,
    in at most two arenas. The gateway's large allocations are request bodies and media (tens of
    MiB, short-lived); with glibc's default dynamic threshold they come from the heap after the
    first few are freed, and the freed space stays in the process (bench/hostile.py measured RSS
    twice its live data after an attack). Other C libraries: nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold, m_arena_max = -3, -8  # glibc's mallopt parameters (malloc.h)
    libc.mallopt(m_mmap_threshold, 256 << 10)
    libc.mallopt(m_arena_max, 2)


async def _public_metrics(request: web.Request, facts: bool) -> web.Response:
    """The public /metrics (``metrics.page``): open to anyone who reaches --port."""
    return web.Response(body=metrics.page(facts), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _every_series(request: web.Request) -> web.Response:
    """The internal port's /metrics: every series (every worker's, with workers)."""
    return web.Response(body=metrics.everything(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _instances(request: web.Request, orch: Orchestrator) -> web.Response:
    """The internal port's /health: as the public one with --epd-facts (every instance's address and
    state, and why each one that is out is out), whatever --epd-facts says."""
    instances = orch.health()
    ok = any(instances.get("lms", {}).values())
    status = "ok" if ok else orch.lm_wait_reason() or "no healthy LM"
    return web.json_response({"status": status, "model": orch.model, **instances, "out": orch.not_admitted()},
                             status=200 if ok else 503)


def _internal_port(cfg: GatewayConfig, orch: Orchestrator, exposure: Exposure, reuse_port: bool) -> MetricsPort:
    """The internal metrics port (--metrics-host:--metrics-port): every series, and /health with the
    instances. ``exposure``: the services' rule (``services.common.metrics_port``) with the gateway's own
    credentials (its certificate, its CA for the scrapers' client certificates, its token).
    ``reuse_port``: a worker's, beside the other workers (each answers with the same merged series)."""
    return MetricsPort(cfg.metrics_host, cfg.metrics_port, exposure, reuse_port=reuse_port,
                       pages={"/metrics": _every_series, "/health": functools.partial(_instances, orch=orch)})


def _grpc_api(cfg: GatewayConfig, servicer: GatewayServicer, interceptors: list, reuse_port: bool) -> GrpcServer:
    """The native gRPC API, not started. ``interceptors``: the gateway's (authentication, intake), run
    before the error boundary; ``reuse_port``: a worker's, beside the other workers."""
    server = GrpcServer(cfg.host, cfg.grpc_port, public=True, interceptors=interceptors,
                        options={"grpc.max_receive_message_length": cfg.max_body_bytes,
                                 "grpc.max_concurrent_streams": PUBLIC_STREAMS_PER_CONNECTION,
                                 **({"grpc.so_reuseport": 1} if reuse_port else {})})
    server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer,
               gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name)
    return server


def _on_signals(stop: asyncio.Event, tenants: Tenants) -> None:
    """SIGINT and SIGTERM stop the gateway; SIGHUP reloads its API keys."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, tenants.reload)


def check(cfg: GatewayConfig, security: SecurityConfig | None = None) -> Exposure | None:
    """Refuses (ValueError) before anything starts: an internal metrics port off loopback that the services'
    rule refuses (``services.common.metrics_port.exposure_for``), and a state secret file that does not load
    (``ResponseIds.from_config``); returns the metrics port's guard (None: no internal port)."""
    ResponseIds.from_config(cfg)
    return exposure_for(cfg.metrics_host, security or SecurityConfig()) if cfg.metrics_port else None


def _rest_app(cfg: GatewayConfig, routes: OpenAIRoutes, tenants: Tenants) -> web.Application:
    """The REST app: authentication first (a refused request is answered before anything else looks at it),
    then the OpenAI routes and the public ``/metrics``."""
    app = web.Application(middlewares=[authenticate(tenants), request_context], client_max_size=cfg.max_body_bytes)
    routes.add_to(app)
    app.router.add_get("/metrics", functools.partial(_public_metrics, facts=cfg.epd_facts))
    return app


async def _rest_site(cfg: GatewayConfig, app: web.Application, worker: WorkerSeat | None) -> web.AppRunner:
    """The REST API's runner, set up and listening (the caller cleans it up).
    handler_cancellation: a client that disconnects cancels its handler, which cancels the LM call (and
    with it the engine request). lingering_time=0: a body the gateway refused unread (413 by its
    Content-Length, 408, 503) is not read and thrown away for 10 s (aiohttp's default); the connection
    closes instead. keepalive_timeout: aiohttp arms it when a connection opens and after each answer, and
    closes the connection if no complete request head came by then: the deadline for headers and idling."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, lingering_time=0,
                           keepalive_timeout=cfg.idle_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port, reuse_port=True if worker else None).start()
    return runner


def _log_listening(cfg: GatewayConfig, worker: WorkerSeat | None, http_port: int, orch: Orchestrator,
                   tenants: Tenants) -> None:
    """The start-up line, with the instances known now (flags, names resolved, the fleet file)."""
    logger.info("gateway %slistening: http://%s:%d/v1 (model %s, %d encoder(s), %d LM(s)%s; API keys: %s)",
                "" if worker is None else f"worker {worker.index} ", cfg.host, http_port,
                orch.model or "not known yet", len(orch.encoders.instances) if orch.encoders is not None else 0,
                len(orch.lms.instances), "" if orch.lm_wait_reason() is None else "; waiting for an LM",
                tenants.describe())


async def serve(cfg: GatewayConfig, stop: asyncio.Event | None = None, security: SecurityConfig | None = None,
                on_listening: Callable[[int, int], None] | None = None, tenants: Tenants | None = None,
                worker: WorkerSeat | None = None) -> None:
    """``security``: how the gateway proves itself to encoders and LMs, and who may
    scrape its internal metrics port off loopback (its own REST and gRPC API are the
    public face and take no internal credentials).
    ``on_listening(http_port, grpc_port)`` is called once both listeners are
    bound, with the ports they hold: the one the OS chose for a ``cfg.port`` of
    0 (how tests run it without guessing a free port), 0 for a disabled gRPC API.
    ``tenants``: the clients' API keys (default: ``cfg``'s, loaded here); SIGHUP
    reloads them.
    ``cfg.workers`` > 1 and no ``worker``: runs the workers' supervisor (``workers.supervise``) instead.
    ``worker``: this process is one of them (``--worker-of``): its ports are shared (SO_REUSEPORT)."""
    bound_allocator()
    stop = stop or asyncio.Event()
    exposure = check(cfg, security)
    if cfg.workers > 1 and worker is None:
        await workers.supervise(cfg, security or SecurityConfig(), stop)
        return
    tenants = tenants or Tenants.from_config(cfg)
    _on_signals(stop, tenants)
    state = await open_for(cfg, worker)  # where the limits are counted: a store shared by every process, or memory
    orch = Orchestrator(cfg, security, quota=tenants.quota, state=state)  # quotas read at every decision: SIGHUP swaps them
    fetcher = MediaFetcher(cfg)  # http(s) image URLs; closed below, after the listeners stop
    runner = grpc_server = core = internal = watch = None
    # Large bodies parsed in a helper process, off this loop; stopped below, after the listeners.
    parser = ParsePool(cfg, int(cfg.parse_offload_mib * (1 << 20))) if cfg.parse_offload_mib > 0 else None
    # The latency objectives' attainment (a scaling signal), published every second while the gateway serves.
    published = objectives.keep_published(cfg.objective_window_s, cfg.objective_ttft_ms, cfg.objective_tpot_ms)
    try:  # everything set up so far is torn down on the way out, also after a failed start
        # Resolves names, checks every instance once, then keeps checking. No peer need be up: until
        # an LM is admitted (its model learned) /health and every request answer 503.
        await orch.start()
        await workers.ready_to_join(worker, lambda: orch.lm_wait_reason() is None)
        # Every body is read under the intake limits (size, readers, memory, deadline) before admission.
        intake = Intake(cfg, quota=tenants.quota)
        if parser is not None:
            await parser.start()
        # One for both transports: they share what it remembers (and its background places, counted in `state`).
        core = RequestCore(cfg, orch, fetcher, quota=tenants.quota, state=state, parser=parser)
        runner = await _rest_site(cfg, _rest_app(cfg, OpenAIRoutes(cfg, orch, fetcher=fetcher, intake=intake,
                                                                   core=core), tenants), worker)
        http_port, grpc_port = runner.addresses[0][1], 0
        if cfg.grpc_port:
            grpc_server = _grpc_api(cfg, GatewayServicer(cfg, orch, fetcher=fetcher, core=core),
                                    [GrpcAuth(tenants), GrpcIntake(intake)], reuse_port=worker is not None)
            grpc_port = await grpc_server.start()
            await grpc_server.set_serving(True)
        if exposure is not None:
            internal = _internal_port(cfg, orch, exposure, reuse_port=worker is not None)
            await internal.start()
        if on_listening is not None:
            on_listening(http_port, grpc_port)
        watch = workers.serving(worker, stop) if worker is not None else None
        _log_listening(cfg, worker, http_port, orch, tenants)
        await stop.wait()
    finally:
        published.cancel()
        if watch is not None:
            watch.cancel()
        if grpc_server is not None:
            await grpc_server.stop()
        if runner is not None:
            await runner.cleanup()
        if internal is not None:
            await internal.stop()
        if core is not None:
            await core.close()
        if parser is not None:
            await parser.close()
        await fetcher.close()
        await orch.close()
        await state.close()  # last: whatever held a place has given it back
