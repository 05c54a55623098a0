"""Who sees which series (no servers: the pages and the guards are built directly). The gateway's
public /metrics shows request and refusal counts, never a routing decision, an instance or a stage
time, unless --epd-facts; the internal port shows everything. A metrics port is guarded as the
service's API port is: open on loopback, TLS and authenticated scrapers anywhere else."""

from __future__ import annotations

import ssl

import pytest
from prometheus_client import REGISTRY, generate_latest

from peerauth import SecurityConfig
from services.certs import make_certs, make_token
from services.common.metrics_port import Exposure, exposure_for
from services.encoder.config import EncoderServiceConfig
from services.fleet_memory import scoring
from services.gateway import metrics, routing
from services.gateway import server as _server  # noqa: F401 - every gateway module: all its series registered
from services.gateway.config import GatewayConfig
from services.gateway.instances import HEALTHY, OUTSTANDING
from services.lm.config import LMServiceConfig

pytestmark = pytest.mark.unit

ADDRESS = "10.9.8.7:50051"
HIDDEN = ("epd_gateway_encoder_routing_total", "epd_gateway_lm_routing_total", "epd_gateway_stage_seconds",
          "epd_gateway_instance_", "epd_gateway_items_total", ADDRESS)


@pytest.fixture
def routed():
    """The series a routed image request moves: held decisions for an encoder and an LM, an admitted
    instance with a call in flight, a request answered, an encode time."""
    routing.DECISIONS.labels("held").inc()
    scoring.DECISIONS.labels("held").inc()
    HEALTHY.labels("encoder", ADDRESS).set(1)
    OUTSTANDING.labels("encoder", ADDRESS).set(1)
    metrics.REQUESTS.labels("chat", "200").inc()
    metrics.STAGE.labels("encode").observe(0.01)
    yield
    for gauge in (HEALTHY, OUTSTANDING):
        gauge.remove("encoder", ADDRESS)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return {**make_certs(str(d / "tls"), ["localhost"]), "auth_token_file": make_token(str(d / "token"))}


def test_the_public_page_shows_no_routing_decision_no_instance_and_no_stage_time(routed):
    page = metrics.page(facts=False).decode()
    assert 'epd_gateway_requests_total{route="chat",status="200"}' in page
    for hidden in HIDDEN:
        assert hidden not in page, hidden


def test_with_epd_facts_and_on_the_internal_port_every_series_shows(routed):
    for page in (metrics.page(facts=True).decode(), generate_latest(REGISTRY).decode()):
        assert 'epd_gateway_encoder_routing_total{decision="held"}' in page
        assert 'epd_gateway_lm_routing_total{decision="held"}' in page
        assert f'epd_gateway_instance_outstanding{{instance="{ADDRESS}",role="encoder"}} 1.0' in page


def test_every_public_series_is_one_the_gateway_registers():
    page = generate_latest(REGISTRY).decode()
    assert not [name for name in metrics.PUBLIC if f"# TYPE {name} " not in page]


def test_every_service_binds_its_metrics_port_to_loopback_by_default():
    assert GatewayConfig(lms="127.0.0.1:1").metrics_host == "127.0.0.1"
    assert EncoderServiceConfig().metrics_host == "127.0.0.1"
    assert LMServiceConfig().metrics_host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "epd-lm"])
def test_a_metrics_port_beyond_loopback_without_tls_and_authentication_is_refused_unless_insecure(host, caplog):
    with pytest.raises(ValueError, match="the metrics port"):
        exposure_for(host, SecurityConfig())
    assert exposure_for(host, SecurityConfig(insecure=True)) == Exposure()
    assert "allowed by --insecure" in caplog.text


def test_on_loopback_a_metrics_port_is_plain_http_whatever_the_api_port_asks(pki):
    assert exposure_for("127.0.0.1", SecurityConfig(**pki)) == Exposure()


def test_beyond_loopback_a_metrics_port_presents_the_service_certificate_and_asks_a_client_one_and_the_token(pki):
    security = SecurityConfig(**pki)
    exposure = exposure_for("0.0.0.0", security)
    assert exposure.ssl is not None and exposure.ssl.verify_mode == ssl.CERT_REQUIRED
    assert exposure.token == security.token != ""


def test_beyond_loopback_without_a_ca_a_metrics_port_asks_the_token_over_tls(pki):
    security = SecurityConfig(tls_cert=pki["tls_cert"], tls_key=pki["tls_key"], auth_token_file=pki["auth_token_file"])
    exposure = exposure_for("10.1.2.3", security)
    assert exposure.ssl is not None and exposure.ssl.verify_mode == ssl.CERT_NONE
    assert exposure.token == security.token
