"""Is a service serving? Asked once: an encoder's or an LM's ``grpc.health.v1`` answer
(``grpc_serving``), a gateway's HTTP ``/health`` (``http_ok``), and which encoders and LMs a gateway
has admitted (``gateway_admitted``, from its metrics).

``epd health`` (a Kubernetes exec probe for services that speak TLS) and ``epd up`` (waiting for its
services) ask them. They need grpc, HTTP and the security settings only: ``epd health`` runs beside a
gateway, which loads neither torch nor vLLM, and so does this module (``tests/unit/test_layering.py``)."""

from __future__ import annotations

import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

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


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def gateway_admitted(url: str, encoders: list[str], lms: list[str], timeout: float = 2.0,
                     metrics_url: str = "") -> bool:
    """True once the gateway at ``url`` (its HTTP root) is ready and has admitted every one of these
    encoder and LM addresses (its ``epd_gateway_instance_healthy`` gauge, read at ``metrics_url``: its
    internal ``--metrics-port``'s /metrics, or by default ``url``'s, which shows the gauge only with
    ``--epd-facts``). The gateway is ready (/health 200) with one LM admitted; the others join at a later
    health round (their first check can time out on a loaded host), and a request sent before goes
    around them (an image is encoded on the LM)."""
    try:
        with urllib.request.urlopen(metrics_url or url + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return False
    admitted = set()
    for family in text_string_to_metric_families(text):
        if family.name == "epd_gateway_instance_healthy":
            admitted |= {(s.labels.get("role"), s.labels.get("instance")) for s in family.samples if s.value == 1}
    want = {("encoder", a) for a in encoders} | {("lm", a) for a in lms}
    return want <= admitted and http_ok(url + "/health", timeout)
