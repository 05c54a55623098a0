"""NIXL's side channel on prefill and decode LMs: where it may listen (``LMServiceConfig``'s bind rule,
``services.lm.server.kv_transfer_config``)."""

from __future__ import annotations

import os

import pytest

from services.lm.config import LMServiceConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "10.1.2.3"])
def test_the_side_channel_binds_loopback_whatever_the_api_host_is(role, host):
    assert LMServiceConfig(host=host, role=role).kv_host == "127.0.0.1"


@pytest.mark.parametrize("kv_host", ["", "::", "[::]", "0", "0.0.0.0"])
def test_the_side_channel_never_listens_on_every_interface_even_with_the_opt_in(kv_host):
    for insecure in (False, True):
        with pytest.raises(ValueError, match="never listens on every interface"):
            LMServiceConfig(kv_host=kv_host, role="prefill", insecure_kv_side_channel=insecure)
    LMServiceConfig(kv_host=kv_host)  # role both: no KV connector, no side channel


@pytest.mark.parametrize("kv_host", ["10.1.2.3", "lm-0.internal", "fd00::5", "[fd00::5]"])
def test_a_side_channel_other_hosts_reach_needs_the_opt_in(kv_host):
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match="--insecure-kv-side-channel"):
            LMServiceConfig(kv_host=kv_host, role=role)
        assert LMServiceConfig(kv_host=kv_host, role=role, insecure_kv_side_channel=True).kv_host == kv_host


@pytest.mark.parametrize("kv_host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_any_loopback_address_needs_no_opt_in(kv_host):
    LMServiceConfig(kv_host=kv_host, role="decode")


def test_vllm_is_told_the_loopback_side_channel_when_the_api_listens_on_every_interface(monkeypatch):
    server = pytest.importorskip("services.lm.server")
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    kv = server.kv_transfer_config(LMServiceConfig(host="0.0.0.0", role="prefill", kv_port=5611))
    assert kv is not None and kv.kv_role == "kv_producer"
    assert (os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("127.0.0.1", "5611")
    assert server.kv_transfer_config(LMServiceConfig(host="0.0.0.0")) is None  # role both: no connector
