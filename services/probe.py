"""Is a service serving? Its ``grpc.health.v1`` answer, asked once.

``epd health`` (a Kubernetes exec probe for services that speak TLS) and ``epd up`` (waiting for its
encoders and LMs) ask it. It needs grpc and the security settings only: ``epd health`` runs beside a
gateway, which loads neither torch nor vLLM, and so does this module (``tests/unit/test_layering.py``)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerauth import SecurityConfig


def grpc_serving(address: str, timeout: float = 1.0, security: SecurityConfig | None = None,
                 service: str = "") -> bool:
    """grpc.health.v1 says ``service`` ("" = the process) at ``address`` is SERVING."""
    try:
        with (security or SecurityConfig()).channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
