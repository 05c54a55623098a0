"""Every connector knob is settable: the services set some from their own flags, and each of
the others is an ``epd encoder`` / ``epd lm`` flag (``--connector-*``) that reaches the engine's
``ec_connector_extra_config`` (issue 14)."""

from __future__ import annotations

import dataclasses

import pytest

from ectransfer.connector.config import ConnectorConfig, ConnectorTuning
from peerauth import SecurityConfig
from services.cli import build_parser
from services.common.config import from_args
from services.common.engine import EngineConfig
from services.encoder import server as encoder_server
from services.encoder.config import EncoderServiceConfig
from services.lm import server as lm_server
from services.lm.config import LMServiceConfig

pytestmark = pytest.mark.unit


def _extra(role: str, tuning: ConnectorTuning) -> dict:
    engine = EngineConfig(model="m")
    if role == "encoder":
        cfg = encoder_server._ec_config(EncoderServiceConfig(), engine, 5000, SecurityConfig(), tuning)
    else:
        cfg = lm_server._ec_config(LMServiceConfig(), engine, SecurityConfig(), tuning)
    return cfg["ec_connector_extra_config"]


@pytest.mark.parametrize("role", ["encoder", "lm"])
def test_every_connector_knob_is_a_flag_or_set_by_the_service(role):
    ns = build_parser().parse_args([role, "--connector-item-wait-s", "7.5", "--no-connector-read-in-place",
                                    "--connector-max-settled-claims", "99", "--connector-chunk-nbytes", "65536"])
    tuning = from_args(ConnectorTuning, ns, prefix="connector_")
    extra = _extra(role, tuning)
    cfg = ConnectorConfig.from_extra(extra)  # what the engine's connector reads
    assert (cfg.item_wait_s, cfg.read_in_place, cfg.max_settled_claims, cfg.chunk_nbytes) == (7.5, False, 99, 65536)
    knobs = {f.name for f in dataclasses.fields(ConnectorConfig)}
    assert knobs == set(extra), "every connector knob travels (a half ignores the other half's)"
    set_by_encoder = {"transfer_host", "advertise_host", "transfer_port", "outbound_pool_bytes", "host_tier_bytes",
                      "lease_s"}
    set_by_lm = {"staging_bytes", "transfer_timeout_s"}
    set_by_both = {"transports", "model_name", "security"}
    set_by_bridge = {"service_pid"}  # ec_transfer_config: the pid of the process that builds the engine
    tuned = {f.name for f in dataclasses.fields(ConnectorTuning)}
    assert knobs == set_by_encoder | set_by_lm | set_by_both | set_by_bridge | tuned, (
        "a connector knob that neither a service sets nor a --connector-* flag reaches")


@pytest.mark.parametrize("role", ["encoder", "lm"])
def test_the_services_defaults_are_the_connectors(role):
    """Declared once: a service flag that feeds a connector knob takes its default from ConnectorConfig."""
    c = ConnectorConfig()
    extra = ConnectorConfig.from_extra(_extra(role, ConnectorTuning()))
    for name in (["transfer_host", "outbound_pool_bytes", "lease_s"] if role == "encoder"
                 else ["staging_bytes", "transfer_timeout_s"]):
        assert getattr(extra, name) == getattr(c, name), name


def test_a_bad_connector_flag_is_refused_before_any_engine_starts(capsys):
    from services.cli import main

    assert main(["lm", "--connector-max-sessions", "0"]) == 2
    assert "max_sessions must be > 0" in capsys.readouterr().err
