"""The Kubernetes example (docker/k8s/epd-serve.yaml) stays in step with the
CLI: every container's args parse, and the gateway finds the headless names."""

from __future__ import annotations

import os

import pytest

from services.cli import build_parser
from services.common.config import from_args
from services.gateway.config import GatewayConfig

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.unit

MANIFEST = os.path.join(os.path.dirname(__file__), "..", "..", "docker", "k8s", "epd-serve.yaml")


def _containers() -> dict[str, dict]:
    with open(MANIFEST) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {c["name"]: c for d in docs if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]}


def test_every_container_args_parse_with_the_epd_cli():
    containers = _containers()
    assert set(containers) == {"encoder", "lm", "gateway"}
    for name, c in containers.items():
        ns = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]])
        assert ns.cmd == name


def test_the_gateway_points_at_the_headless_services_and_probes_health():
    gw = _containers()["gateway"]
    cfg = from_args(GatewayConfig, build_parser().parse_args(gw["args"]))
    assert cfg.encoder_list == ["epd-encoder:50051"] and cfg.lm_list == ["epd-lm:50061"]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health"
    enc = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in _containers()["encoder"]["args"]])
    assert enc.advertise_host == "10.0.0.7"
