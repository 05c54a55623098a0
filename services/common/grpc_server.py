"""gRPC server wiring shared by the services: health, reflection (when asked
for), authentication (``peerauth``), errors, shutdown."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from peerauth import SecurityConfig
from services.common.errors import ErrorInterceptor

logger = logging.getLogger(__name__)

STOP_MARGIN_S = 5.0
"""How long past its grace a stopping server may take before it is left to the process's exit."""

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    # Servers accept the gateway's keepalive pings (every 10 s, also between calls)
    # instead of answering them with GOAWAY "too_many_pings".
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class GrpcServer:
    """A grpc.aio server with grpc.health.v1, and reflection when
    ``security.reflection`` asks for it.

    ``add(add_fn, servicer, service_name)`` registers a service; ``start``
    binds (TLS and the token check per ``security``: an unauthenticated call
    is refused before any handler runs); ``set_serving`` flips readiness;
    ``stop`` marks NOT_SERVING first, then stops with a grace period (the
    shutdown order of the house style).
    """

    def __init__(self, host: str, port: int, security: SecurityConfig | None = None, public: bool = False,
                 interceptors: list | None = None, options: dict | None = None) -> None:
        """``public``: a client-facing API (the gateway's), open to callers like its REST port.
        ``interceptors`` run after authentication, before the error boundary; ``options`` replace
        entries of ``GRPC_OPTIONS`` (the public port's smaller message limit)."""
        self.security = security or SecurityConfig()
        self.public = public
        opts = dict(GRPC_OPTIONS) | (options or {})
        self.server = grpc.aio.server(
            interceptors=[*self.security.server_interceptors(), *(interceptors or []), ErrorInterceptor()],
            options=list(opts.items()))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host = host
        self.address = f"{host}:{port}"
        self._names = [health.SERVICE_NAME]
        if self.security.reflection:
            self._names.append(reflection.SERVICE_NAME)
        self.port: int | None = None

    def add(self, add_fn, servicer, service_name: str) -> None:
        add_fn(servicer, self.server)
        self._names.append(service_name)

    async def start(self) -> int:
        if self.security.reflection:
            reflection.enable_server_reflection(self._names, self.server)
        if not self.public:
            self.security.require_for(self.host, f"gRPC API {self.address}")
        self.port = self.security.add_port(self.server, self.address)
        if not self.port:
            raise OSError(f"cannot bind {self.address}")
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        try:
            # Bounded: grpc.aio's stop was seen to hang (once, after a refused TLS handshake), and a
            # service that cannot stop cannot exit for its supervisor to restart it.
            await asyncio.wait_for(self.server.stop(grace), grace + STOP_MARGIN_S)
        except asyncio.TimeoutError:
            logger.warning("gRPC server on port %s did not stop within %.0f s; leaving it", self.port,
                           grace + STOP_MARGIN_S)
