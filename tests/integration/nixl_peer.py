"""A guarded NIXL handshake listener on a thread of the test, and the peers that dial it with real ZMQ
sockets: a decode engine's handshake (a REQ, as vLLM's ``_nixl_handshake`` sends it) and a raw DEALER
that can send any frames in order on one connection."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import zmq

from services.lm.kv_peers import PeerCheck
from services.lm.nixl_listener import GET_META_MSG, MAX_FRAME, Admit, HandshakeListener

METADATA = b"this engine's NIXL agent metadata"
ANSWERS = {(0, 0): METADATA, (0, 1): b"tp rank 1's metadata"}
WAIT_MS = 60_000
"""How long a peer waits for an answer it expects (only a failing test waits this long)."""


def request(pp_rank: int = 0, tp_rank: int = 0) -> bytes:
    """A well-formed handshake request, encoded as vLLM's decode engine encodes it."""
    return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))


enc = msgspec.msgpack.encode
MALFORMED = {  # a message's frames as a DEALER sends them, by what is wrong with them
    "empty": [b"", b""],
    "not msgpack": [b"", b"\xc1 not msgpack"],
    "truncated": [b"", request()[:-3]],
    "a huge length, truncated": [b"", b"\xc6\xff\xff\xff\xff" + b"x" * 16],
    "nested deeper than any decoder allows": [b"", b"\x91" * (MAX_FRAME - 8)],
    "the verb as text": [b"", enc(("get_meta_msg", 0, 0))],
    "ranks as text": [b"", enc((b"get_meta_msg", "0", "0"))],
    "a rank as a list": [b"", enc((b"get_meta_msg", [0], 0))],
    "a rank as a float": [b"", enc((b"get_meta_msg", 0.5, 0))],
    "two values": [b"", enc((b"get_meta_msg", 0))],
    "four values": [b"", enc((b"get_meta_msg", 0, 0, 0))],
    "a map": [b"", enc({"get_meta_msg": 0})],
    "a bare integer": [b"", enc(42)],
    "another verb": [b"", enc((b"give_me_everything", 0, 0))],
    "a rank this engine does not have": [b"", enc((b"get_meta_msg", 7, 7))],
    "no envelope": [request()],
    "a non-empty envelope": [b"x", request()],
    "an extra frame": [b"", request(), b"extra"],
}


@contextlib.contextmanager
def listening(admit: Admit | None = None, host: str = "127.0.0.1") -> Iterator[HandshakeListener]:
    """A ``HandshakeListener`` serving ``ANSWERS`` on a free port of ``host`` (its ``port`` is set once
    bound), stopped and joined on exit. ``admit``: the real ``PeerCheck`` unless given."""
    listener = HandshakeListener(ANSWERS, host, 0, admit or PeerCheck())
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=listener.run, args=(ready, stop), daemon=True, name="nixl_handshake_listener")
    thread.start()
    assert ready.wait(30) and listener.port, "the listener did not bind"
    try:
        yield listener
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive()


def handshake(host: str, port: int, pp_rank: int = 0, tp_rank: int = 0, wait_ms: int = WAIT_MS) -> list[bytes] | None:
    """One handshake from a fresh REQ socket: the answer's frames, or None without one in ``wait_ms``."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, wait_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        sock.send(request(pp_rank, tp_rank))
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def dealer(host: str, port: int) -> Iterator[zmq.Socket]:
    """A DEALER connected to the listener: what it sends arrives in order on one connection (a REQ's
    envelope is the empty frame it sends first); it waits ``WAIT_MS`` for an answer."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"tcp://{host}:{port}")
        yield sock
    finally:
        ctx.destroy(linger=0)


def guarded_scheduler(kv_transfer_config):
    """Our NixlConnector's scheduler half (``services.lm.nixl_connector``) built by vLLM's own ``__init__``
    for one rank and no KV cache groups: enough for vLLM to start its handshake listener thread when the
    test sets the handshake metadata (vLLM reads the host and port from VLLM_NIXL_SIDE_CHANNEL_HOST/PORT;
    port 0 is a free one). The caller shuts it down (vLLM's ``shutdown`` stops and joins the thread)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from services.lm.nixl_connector import GuardedNixlScheduler

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, data_parallel_index=0),
        cache_config=SimpleNamespace(block_size=16), kv_transfer_config=kv_transfer_config,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True))
    return GuardedNixlScheduler(config, kv_transfer_config.engine_id,
                                KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[]))
