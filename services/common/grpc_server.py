"""gRPC server wiring shared by the services: health, reflection, errors, shutdown."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ErrorInterceptor

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
]


class GrpcServer:
    """A grpc.aio server with grpc.health.v1 and reflection on.

    ``add(add_fn, servicer, service_name)`` registers a service; ``start``
    binds; ``set_serving`` flips readiness; ``stop`` marks NOT_SERVING first,
    then stops with a grace period (the shutdown order of the house style).
    """

    def __init__(self, host: str, port: int) -> None:
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=GRPC_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"{host}:{port}"
        self._names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.port: int | None = None

    def add(self, add_fn, servicer, service_name: str) -> None:
        add_fn(servicer, self.server)
        self._names.append(service_name)

    async def start(self) -> int:
        reflection.enable_server_reflection(self._names, self.server)
        self.port = self.server.add_insecure_port(self.address)
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
        await self.server.stop(grace)
