"""The guarded NIXL handshake listener (``services.lm.nixl_listener``, what our NixlConnector's scheduler
runs in the EngineCore) on a thread of the test, dialed with real ZMQ sockets: a malformed message of
any shape is dropped and the next well-formed handshake is answered; only the deployment's user gets an
answer on this host (``services.lm.kv_peers``, against the kernel's real socket table)."""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.lm import kv_peers
from services.lm.config import LMServiceConfig
from services.lm.nixl_listener import HandshakeListener
from tests.integration.nixl_peer import (
    ANSWERS,
    MALFORMED,
    METADATA,
    dealer,
    guarded_scheduler,
    handshake,
    listening,
    request,
)

pytestmark = pytest.mark.integration



def _answered(reply: list[bytes], payload: bytes = METADATA) -> bool:
    """Whether ``reply`` (a DEALER's: the empty envelope first) is a handshake answer as vLLM's decode
    engine reads it: the payload, then the listener's perf_counter as msgpack."""
    return len(reply) == 3 and reply[0] == b"" and reply[1] == payload and \
        isinstance(msgspec.msgpack.decode(reply[2]), float)


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_message_gets_no_answer_and_the_next_handshake_on_the_same_connection_does(frames):
    with listening() as listener, dealer("127.0.0.1", listener.port) as peer:
        peer.send_multipart(frames)
        peer.send_multipart([b"", request()])
        # One connection keeps its order: the first answer that comes is the handshake's, sent after the
        # malformed message was dealt with (vLLM's own listener dies there and answers nothing).
        assert _answered(peer.recv_multipart())
        assert sum(listener.refused.values()) == 1 and listener.answered == 1
        reply = handshake("127.0.0.1", listener.port)  # and on a new connection, as vLLM dials
        assert reply is not None and reply[0] == METADATA


def test_every_malformed_shape_in_a_row_leaves_the_listener_answering_each_rank_it_serves():
    with listening() as listener, dealer("127.0.0.1", listener.port) as peer:
        for _ in range(20):
            for frames in MALFORMED.values():
                peer.send_multipart(frames)
        peer.send_multipart([b"", msgspec.msgpack.encode((b"get_meta_msg", 0, 1))])
        assert _answered(peer.recv_multipart(), ANSWERS[(0, 1)])
        assert sum(listener.refused.values()) == 20 * len(MALFORMED)
        assert set(listener.refused) == {"frames", "body", "verb", "rank"}
        reply = handshake("127.0.0.1", listener.port)
        assert reply is not None and reply[0] == METADATA


def test_a_frame_over_the_size_limit_drops_its_connection_before_python_sees_it():
    with listening() as listener:
        with dealer("127.0.0.1", listener.port) as peer:
            monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.RCVTIMEO, 60_000)
            peer.send_multipart([b"", b"\x00" * (4 << 20)])
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            peer.disable_monitor()
        reply = handshake("127.0.0.1", listener.port)
        assert reply is not None and reply[0] == METADATA
        assert sum(listener.refused.values()) == 0  # libzmq dropped it: the loop never saw those bytes


def test_a_listener_whose_port_is_held_binds_it_once_freed_and_lets_the_engine_start_meanwhile():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    listener = HandshakeListener(ANSWERS, "127.0.0.1", port, kv_peers.PeerCheck())
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=listener.run, args=(ready, stop), daemon=True)
    thread.start()
    try:
        assert ready.wait(60)  # vLLM waits on it before the engine goes on
        holder.close()
        reply = handshake("127.0.0.1", port)  # ZMQ dials again until the listener binds
        assert reply is not None and reply[0] == METADATA
    finally:
        holder.close()
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_the_socket_table_names_this_processs_user_for_both_ends_of_its_connection_and_nobody_for_another():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    peer, local = client.getsockname(), server.getsockname()
    try:
        assert kv_peers.socket_owner(peer, local) == os.geteuid()
        assert kv_peers.socket_owner(local, peer) == os.geteuid()  # the accepted end, read the other way
        assert kv_peers.socket_owner(peer, (local[0], 1)) is None  # no such connection
    finally:
        client.close()
        conn.close()
        server.close()


def _zmtp_dealer_as(uid: int, port: int, body: bytes) -> int:
    """A child process that becomes ``uid`` and sends [b"", body] to the listener as a DEALER, speaking
    ZMTP 3.1 over a plain socket (no ZMQ context crosses the fork); waits for an answer until killed.
    Returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        s = socket.socket()  # made as ``uid``: the socket table names its creator
        s.connect(("127.0.0.1", port))  # an address, not a name: the child may not read the codecs any more
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER\x08Identity" + struct.pack(">I", 0)
        s.sendall(greeting + bytes([0x04, len(ready)]) + ready)
        got = b""
        while len(got) < 66 or len(got) < 66 + got[65]:  # the listener's greeting and READY: then a message
            got += s.recv(4096) or os._exit(1)
        s.sendall(b"\x01\x00" + bytes([0x00, len(body)]) + body)
        while s.recv(4096):
            pass
    finally:
        os._exit(0)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="needs root (to run a peer as another user) and Linux's /proc/net/tcp")
def test_a_process_of_another_user_on_this_host_gets_no_answer_and_the_deployments_handshake_does():
    with listening() as listener:
        pid = _zmtp_dealer_as(65534, listener.port, request())
        try:
            for _ in range(600):  # until the listener has dealt with it (the deadline is for a failing test)
                if listener.refused["peer"] or listener.answered:
                    break
                time.sleep(0.1)
            assert listener.refused == {"peer": 1} and listener.answered == 0
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        reply = handshake("127.0.0.1", listener.port)
        assert reply is not None and reply[0] == METADATA and listener.answered == 1


def test_vllms_own_scheduler_code_runs_the_guarded_listener_with_its_payload_and_stops_it(monkeypatch):
    nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
    from services.lm.handoff import kv_transfer_config

    kv = kv_transfer_config(LMServiceConfig(role="prefill", kv_port=5600))
    kv.engine_id = "prefill-0"
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")  # after kv_transfer_config set it: a free port
    scheduler = guarded_scheduler(kv)
    payload = nixl.NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"agent")
    scheduler.set_xfer_handshake_metadata({(0, 0): payload})  # vLLM's: encodes, starts its thread, waits ready
    try:
        listener = scheduler.handshake_listener
        with dealer("127.0.0.1", listener.port) as peer:
            peer.send_multipart([b"", b"\xc1"])
            peer.send_multipart([b"", request()])
            reply = peer.recv_multipart()
        # Read as vLLM's decode engine reads it (its _nixl_handshake).
        assert msgspec.msgpack.Decoder(nixl.NixlHandshakePayload).decode(reply[1]) == payload
        assert listener.refused == {"body": 1} and listener.answered == 1
    finally:
        scheduler.shutdown()
    assert handshake("127.0.0.1", listener.port, wait_ms=2000) is None  # stopped: nobody answers
