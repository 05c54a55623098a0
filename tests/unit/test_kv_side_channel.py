"""NIXL's side channel on prefill and decode LMs: where it may listen (``LMServiceConfig``'s bind rule,
``services.lm.handoff.kv_transfer_config``), and the watch that turns a dead listener into NOT_SERVING
(``services.lm.side_channel``, with its probe scripted or against a plain socket)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from services.lm.config import LMServiceConfig
from services.lm.side_channel import UP, SideChannelWatch, accepts

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
    pytest.importorskip("vllm")
    from services.lm import handoff
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    kv = handoff.kv_transfer_config(LMServiceConfig(host="0.0.0.0", role="prefill", kv_port=5611))
    assert kv is not None and kv.kv_role == "kv_producer"
    assert (os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("127.0.0.1", "5611")
    assert handoff.kv_transfer_config(LMServiceConfig(host="0.0.0.0")) is None  # role both: no connector


def _scripted(answers: list[str | None]):
    """A probe that gives ``answers`` in order (then keeps giving the last), and the count of calls."""
    calls = []

    async def probe():
        calls.append(None)
        return answers[min(len(calls), len(answers)) - 1]

    return probe, calls


def _gauge(address: str) -> float:
    return UP.labels(address)._value.get()


def test_a_listener_that_stops_accepting_makes_the_lm_not_serving_once_with_the_reason():
    probe, calls = _scripted([None, "Connection refused", None, "Connection refused", "Connection refused"])
    reported = []

    async def on_dead(reason):
        reported.append(reason)

    watch = SideChannelWatch("127.0.0.1", 5601, on_dead, probe=probe, interval_s=0, failures=2)
    asyncio.run(asyncio.wait_for(watch.run(), 30))
    # One refusal between two answers is not enough; two in a row are, and the watch ends there.
    assert len(calls) == 5 and reported == ["Connection refused"] and watch.dead == "Connection refused"
    assert _gauge("127.0.0.1:5601") == 0


def test_a_listener_that_keeps_accepting_keeps_the_lm_serving_until_the_watch_stops():
    probe, calls = _scripted([None])
    reported = []

    async def on_dead(reason):
        reported.append(reason)

    async def main():
        watch = SideChannelWatch("127.0.0.1", 5602, on_dead, probe=probe, interval_s=0.001)
        watch.start()
        while len(calls) < 20:
            await asyncio.sleep(0.01)
        assert _gauge("127.0.0.1:5602") == 1
        await watch.stop()
        return watch

    watch = asyncio.run(asyncio.wait_for(main(), 30))
    assert reported == [] and watch.dead is None


def test_the_probe_sees_a_listening_port_and_a_closed_one():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        assert asyncio.run(accepts("127.0.0.1", port, 5.0)) is None
    finally:
        listener.close()
    reason = asyncio.run(accepts("127.0.0.1", port, 5.0))
    assert reason is not None and "refused" in reason.lower()


def test_the_watch_refuses_settings_that_could_never_report():
    async def on_dead(reason):
        pass

    for kw in ({"failures": 0}, {"interval_s": -1}, {"timeout_s": 0}):
        with pytest.raises(ValueError, match="failures must be >= 1"):
            SideChannelWatch("127.0.0.1", 5600, on_dead, **kw)
