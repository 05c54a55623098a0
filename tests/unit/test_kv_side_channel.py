"""NIXL's side channel on prefill and decode LMs: where it may listen (``LMServiceConfig``'s bind rule,
``services.lm.handoff.kv_transfer_config``), which connector vLLM loads for it, who gets an answer
(``services.lm.kv_peers``, with the socket table scripted), and the watch that turns a dead listener into
NOT_SERVING (``services.lm.side_channel``, with its probe scripted or against a plain socket)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from services.lm.config import LMServiceConfig
from services.lm.kv_peers import EXTRA_KEY, PeerCheck, parse_peers, socket_owner
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


def test_vllm_loads_our_guarded_nixl_connector_under_vllms_name_with_the_peer_settings(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, NixlPullConnectorScheduler

    from services.lm import handoff, nixl_connector
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    kv = handoff.kv_transfer_config(LMServiceConfig(role="decode", kv_peers="10.0.0.0/24, fd00::7"))
    cls = KVConnectorFactory.get_connector_class(kv)
    assert cls is nixl_connector.NixlConnector and issubclass(cls, NixlPullConnector)
    # vLLM turns its NIXL-specific settings on by the connector's name: they stay on.
    assert kv.has_connector("NixlConnector")
    assert issubclass(nixl_connector.GuardedNixlScheduler, NixlPullConnectorScheduler)
    assert "_nixl_handshake_listener" in vars(nixl_connector.GuardedNixlScheduler)
    check = PeerCheck.from_dict(kv.get_from_extra_config(EXTRA_KEY, None))
    assert [str(n) for n in check.peers] == ["10.0.0.0/24", "fd00::7/128"]


def test_our_listener_answers_vllms_handshake_verb():
    metadata = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
    from services.lm.nixl_listener import GET_META_MSG
    assert GET_META_MSG == metadata.GET_META_MSG


def _owned_by(uid: int | None):
    """A socket table that says every connection is ``uid``'s (None: on no socket of this host)."""
    return lambda peer, local: uid


LOCAL = ("127.0.0.1", 5600)


def test_a_process_on_this_host_gets_an_answer_only_as_the_deployments_user():
    assert PeerCheck(uid=1000, owner=_owned_by(1000))(("127.0.0.1", 40000), LOCAL) is None
    why = PeerCheck(uid=1000, owner=_owned_by(1001))(("127.0.0.1", 40000), LOCAL)
    assert why is not None and "uid 1001" in why
    # Whatever --kv-peers says: a local process of another user reaches the host's own address too.
    why = PeerCheck(peers=parse_peers("10.0.0.5"), uid=1000, owner=_owned_by(0))(("10.0.0.5", 40000), LOCAL)
    assert why is not None and "uid 0" in why


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1"])
def test_a_loopback_peer_the_socket_table_does_not_list_gets_no_answer(peer):
    why = PeerCheck(owner=_owned_by(None))((peer, 40000), LOCAL)
    assert why is not None and "socket table" in why


def test_a_peer_on_another_host_gets_an_answer_from_a_listed_address_or_from_anywhere_with_no_list():
    anyone, listed = PeerCheck(owner=_owned_by(None)), PeerCheck(parse_peers("10.0.0.0/24,fd00::7"), owner=_owned_by(None))
    for peer in ("10.0.0.5", "::ffff:10.0.0.5", "fd00::7", "192.168.1.1"):
        assert anyone((peer, 40000), LOCAL) is None
    assert [listed((p, 40000), LOCAL) is None for p in ("10.0.0.5", "::ffff:10.0.0.5", "fd00::7", "10.0.1.5",
                                                          "fd00::8")] == [True, True, True, False, False]


@pytest.mark.parametrize("spec", ["lm-1.internal", "10.0.0.0/33", "10.0.0.5:5600", "*"])
def test_kv_peers_takes_addresses_and_cidrs_only(spec):
    with pytest.raises(ValueError, match="--kv-peers"):
        LMServiceConfig(role="prefill", kv_peers=spec)
    LMServiceConfig(kv_peers=spec)  # role both: no side channel


def test_the_socket_table_is_read_as_the_kernel_writes_it(tmp_path):
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    # 127.0.0.1:40000 -> 127.0.0.1:5600 (uid 1000), and a v6 socket ::ffff:127.0.0.1:40001 -> ::1:5600 (uid 1001).
    (tmp_path / "tcp").write_text(header + "   0: 0100007F:9C40 0100007F:15E0 01 00000000:00000000 00:00000000 "
                                           "00000000  1000        0 1 1 0 20 4 30 10 -1\n")
    (tmp_path / "tcp6").write_text(header + "   0: 0000000000000000FFFF00000100007F:9C41 "
                                            "00000000000000000000000001000000:15E0 01 00000000:00000000 "
                                            "00:00000000 00000000  1001        0 2 1 0 20 4 30 10 -1\n")
    tables = (str(tmp_path / "tcp"), str(tmp_path / "tcp6"), str(tmp_path / "missing"))
    assert socket_owner(("127.0.0.1", 40000), LOCAL, tables) == 1000
    assert socket_owner(("::ffff:127.0.0.1", 40000), ("::ffff:127.0.0.1", 5600), tables) == 1000
    assert socket_owner(("127.0.0.1", 40001), ("::1", 5600), tables) == 1001
    assert socket_owner(("127.0.0.1", 40000), ("127.0.0.1", 5601), tables) is None


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
