"""Connector settings from vLLM's extra config, and dataclass <-> argparse CLIs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import pytest

from ectransfer.connector.config import ConnectorConfig
from services.common.config import add_dataclass_args, from_args
from services.gateway.config import GatewayConfig

pytestmark = pytest.mark.unit


def test_from_extra_sets_known_keys_and_keeps_defaults():
    cfg = ConnectorConfig.from_extra({"transfer_port": 5555, "chunk_nbytes": 1 << 20, "transports": ["grpc"]})
    assert (cfg.transfer_port, cfg.chunk_nbytes, cfg.transports) == (5555, 1 << 20, ["grpc"])
    assert cfg.staging_bytes == ConnectorConfig().staging_bytes
    assert ConnectorConfig.from_extra({}) == ConnectorConfig()


def test_from_extra_rejects_unknown_keys_listing_the_allowed_ones():
    with pytest.raises(ValueError) as e:
        ConnectorConfig.from_extra({"chunk_bytes": 1, "zzz": 2, "lease_s": 5.0})
    msg = str(e.value)
    assert "['chunk_bytes', 'zzz']" in msg
    assert "allowed:" in msg and "chunk_nbytes" in msg and "transfer_timeout_s" in msg


@pytest.mark.parametrize("transports", [["nope"], ["grpc", "carrier-pigeon"]])
def test_unknown_transport_names_are_rejected(transports):
    with pytest.raises(ValueError, match=r"unknown transport .*allowed: .*grpc"):
        ConnectorConfig.from_extra({"transports": transports})


@pytest.mark.parametrize("name", ["outbound_pool_bytes", "staging_bytes", "chunk_nbytes"])
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be > 0, got {value}"):
        ConnectorConfig.from_extra({name: value})


# --- dataclass <-> argparse ------------------------------------------------------------------------------------


@dataclass
class Sample:
    name: str = "a"
    """The sample's name."""
    count: int = 1
    ratio: float = 0.5
    verbose: bool = False
    enabled: bool = True
    tags: list[str] = field(default_factory=lambda: ["x"])
    """Tags to attach."""
    extra: dict[str, Any] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list, metadata={"nargs": "+"})
    """Space-separated, as a flag mirroring one of vllm serve's."""


def parse(argv, prefix=""):
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Sample, prefix=prefix)
    return parser, parser.parse_args(argv)


def test_no_flags_gives_the_defaults():
    _, ns = parse([])
    assert from_args(Sample, ns) == Sample()


def test_every_kind_of_field_round_trips():
    _, ns = parse([
        "--name", "b", "--count", "3", "--ratio", "1.5", "--verbose", "--no-enabled",
        "--tags", "p,q,,r", "--extra", '{"k": [1, 2], "s": "v"}',
    ])  # fmt: skip
    assert from_args(Sample, ns) == Sample(
        name="b", count=3, ratio=1.5, verbose=True, enabled=False, tags=["p", "q", "r"], extra={"k": [1, 2], "s": "v"}
    )


def test_a_list_field_asking_for_nargs_takes_space_separated_values_that_may_hold_commas():
    _, ns = parse(["--keys", "a,b", "c", "--count", "2"])
    assert from_args(Sample, ns) == Sample(keys=["a,b", "c"], count=2)


def test_prefix_applies_to_flags_and_destinations():
    _, ns = parse(["--s-count", "7", "--no-s-enabled"], prefix="s_")
    cfg = from_args(Sample, ns, prefix="s_")
    assert cfg.count == 7 and cfg.enabled is False and cfg.name == "a"


def test_help_uses_field_docstrings_and_defaults():
    parser, _ = parse([])
    text = " ".join(parser.format_help().split())
    assert "The sample's name. (default: 'a')" in text
    assert "Tags to attach. (default: ['x']) (comma-separated)" in text


@pytest.mark.parametrize("argv", [["--count", "many"], ["--extra", "{not json"], ["--ratio", "x"]])
def test_bad_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error" in capsys.readouterr().err


def test_a_real_service_config_round_trips():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, GatewayConfig)
    cfg = from_args(GatewayConfig, parser.parse_args(["--lms", "h1:1,h2:2", "--max-images", "3"]))
    assert cfg.lm_list == ["h1:1", "h2:2"] and cfg.max_images == 3


def test_auto_is_the_default_and_expands_to_what_this_process_can_use(monkeypatch):
    from ectransfer import factory

    assert ConnectorConfig().transports == ["auto"]
    monkeypatch.setattr(factory, "cuda_ipc_usable", lambda: False)
    assert factory.resolve(["auto"], "producer") == ["shm", "grpc"]
    assert factory.resolve(["auto"], "consumer") == ["shm", "grpc"]
    monkeypatch.setattr(factory, "cuda_ipc_usable", lambda: True)
    # The encoder's pool moves to the GPU, which shm cannot describe.
    assert factory.resolve(["auto"], "producer") == ["cuda_ipc", "grpc"]
    assert factory.resolve(["auto"], "consumer") == ["cuda_ipc", "shm", "grpc"]
    assert factory.resolve(["grpc", "auto"], "consumer") == ["grpc", "cuda_ipc", "shm"]  # explicit order kept
    assert factory.resolve(["shm"], "producer") == ["shm"]  # a single name forces it
    with pytest.raises(ValueError, match="resolve"):
        factory.transport_enum("auto")


def test_cuda_ipc_on_a_machine_without_it_fails_the_encoder_connector_with_the_reason():
    import torch

    from ectransfer.connector.producer import ProducerScheduler
    from ectransfer.protocol import ProtocolError
    from tests.integration.connector_fakes import vllm_config

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = ConnectorConfig(transports=["cuda_ipc", "grpc"], outbound_pool_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="CUDA IPC needs cupy|no CUDA"):
        ProducerScheduler(vllm_config("enc-1"), cfg)
