"""NIXL's handshake listener, guarded: the side channel a decode engine dials to pair with this engine.

vLLM's NixlConnector serves its handshake from one thread in the EngineCore: a ZMQ ROUTER on
``--kv-host``:``--kv-port`` that answers ``(GET_META_MSG, pp_rank, tp_rank)`` (msgpack, from a REQ
socket) with that rank's encoded ``NixlHandshakePayload`` and the listener's ``perf_counter`` (the
decode engine estimates the clock offset from it). vLLM's own loop has no guard around a message: a
frame it cannot decode, a wrong type, an unknown rank or a missing envelope frame ends the thread and
closes the port for good. ``HandshakeListener`` serves the same answer to the same request and drops
everything else, one message at a time:

- libzmq disconnects a peer whose frame exceeds ``MAX_FRAME`` before Python sees it (``MAXMSGSIZE``);
- a message that is not ``[identity, b"", body]`` (a REQ's envelope), a body that is not exactly
  ``(bytes, int, int)`` msgpack, another verb or a rank this engine has no answer for gets no answer;
- ``admit`` (``services.lm.kv_peers.PeerCheck``) says whether the peer's connection may have one at all;
- anything a message still raises is logged and the loop goes on; if the socket itself fails, ``run``
  binds the same port again after ``RETRY_S``.

A refused peer gets nothing (a REQ waits for its own timeout): nothing in vLLM's handshake could read
an error. Who runs it: ``services.lm.nixl_connector``'s scheduler, on vLLM's ``nixl_handshake_listener``
thread, with vLLM's arguments (the answers, the ready and stop events, host, port). It owns its ZMQ
context and socket and destroys both when ``stop`` is set. No vLLM import here: tests drive it with
real ZMQ sockets and no engine.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger(__name__)

GET_META_MSG = b"get_meta_msg"
"""The one verb of vLLM's handshake (``vllm...nixl.metadata.GET_META_MSG``; a test pins the two equal)."""
MAX_FRAME = 4096
"""Largest inbound frame, in bytes; a handshake request is about 20 (libzmq drops a peer that sends more)."""
POLL_MS = 500
"""How often the loop looks at the stop event while no message comes."""
RETRY_S = 1.0
"""Wait before binding again after the socket failed (or could not bind)."""
RETRY_MAX_S = 30.0

Address = tuple[str, int]
Admit = Callable[[Address, Address], str | None]
"""``admit(peer, local)``: None when the connection from ``peer`` to this listener's ``local`` address may
have an answer, else why not (logged)."""

_REQUEST = msgspec.msgpack.Decoder(tuple[bytes, int, int])


def admit_all(peer: Address, local: Address) -> str | None:
    """The ``admit`` that admits every peer (tests of the frame guard)."""
    return None


def _zmq_path(host: str, port: int | str) -> str:
    """``tcp://host:port``, an IPv6 address in brackets (as vLLM's ``make_zmq_path`` writes it)."""
    host = host.strip("[]")
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"tcp://[{host}]:{port}" if v6 else f"tcp://{host}:{port}"


def _ends(fd: int) -> tuple[Address, Address]:
    """The (peer, local) addresses of the TCP connection ``fd`` (libzmq's; a duplicate is read and closed)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        return s.getpeername()[:2], s.getsockname()[:2]


class HandshakeListener:
    """Serves ``answers[(pp_rank, tp_rank)]`` on ``host``:``port`` (0: a free port, then kept across
    rebinds); see the module docstring. ``answers`` are the encoded payloads vLLM built; this class
    neither copies nor frees them."""

    def __init__(self, answers: dict[tuple[int, int], bytes], host: str, port: int, admit: Admit) -> None:
        self.answers = answers
        self.host, self.port = host, port
        self.admit = admit
        self.refused: Counter[str] = Counter()
        """Messages dropped, by kind (``frames``, ``body``, ``verb``, ``rank``, ``peer``, ``error``)."""
        self.answered = 0
        """Handshakes answered."""

    def run(self, ready: threading.Event, stop: threading.Event) -> None:
        """Binds and serves until ``stop`` is set; sets ``ready`` once the socket is bound (or its first
        bind failed: the engine does not wait forever on a port another process holds). A failed socket
        is logged and bound again after ``RETRY_S``, doubled after each failure in a row up to
        ``RETRY_MAX_S`` (a port held for good is not a log flood)."""
        delay = RETRY_S
        while not stop.is_set():
            ctx = zmq.Context()
            try:
                sock = self._bind(ctx)
                delay = RETRY_S
                ready.set()
                self._serve(sock, stop)
            except Exception:  # the socket itself failed: bind again; one message never gets here
                logger.exception("NIXL's side channel %s failed; binding it again in %g s",
                                 _zmq_path(self.host, self.port), delay)
            finally:
                ctx.destroy(linger=0)
            ready.set()
            stop.wait(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def _bind(self, ctx: zmq.Context) -> zmq.Socket:
        """The ROUTER socket, bound; ``port`` 0 becomes the port it got (kept for a rebind)."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(_zmq_path(self.host, self.port or "*"))
        self.port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2])
        logger.info("NIXL's side channel listens on %s (guarded)", _zmq_path(self.host, self.port))
        return sock

    def _serve(self, sock: zmq.Socket, stop: threading.Event) -> None:
        """One message at a time until ``stop`` is set (looked at every ``POLL_MS``)."""
        while not stop.is_set():
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                continue
            self._handle(sock, frames)

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        """Answers one message or drops it; never raises."""
        try:
            kind, why, reply = self._answer(frames)
        except Exception as e:  # a guard that failed still drops only this message
            kind, why, reply = "error", f"{type(e).__name__}: {e}", None
            logger.debug("NIXL's side channel: a message raised", exc_info=True)
        if reply is None:
            self._refuse(kind, why)
            return
        self.answered += 1  # before the send: whoever holds the answer sees it counted
        try:
            sock.send_multipart((frames[0].bytes, b"", reply, msgspec.msgpack.encode(time.perf_counter())))
        except zmq.ZMQError as e:  # the peer went away: nothing was answered
            self.answered -= 1
            self._refuse("error", f"send: {e}")

    def _answer(self, frames: list[zmq.Frame]) -> tuple[str, str, bytes | None]:
        """(kind, why, None) for a message to drop, ("", "", payload) for one to answer."""
        if len(frames) != 3 or frames[1].bytes != b"":
            return "frames", f"{len(frames)} frames, not a REQ's [identity, '', request]", None
        why = self.admit(*_ends(frames[2].get(zmq.SRCFD)))
        if why is not None:
            return "peer", why, None
        try:
            verb, pp_rank, tp_rank = _REQUEST.decode(frames[2].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return "body", f"not (verb, pp_rank, tp_rank): {e}", None
        if verb != GET_META_MSG:
            return "verb", f"verb {verb[:32]!r}", None
        reply = self.answers.get((pp_rank, tp_rank))
        if reply is None:
            return "rank", f"no pp rank {pp_rank}, tp rank {tp_rank} here", None
        return "", "", reply

    def _refuse(self, kind: str, why: str) -> None:
        """Counts a dropped message; logs the first of each kind and then every 100th (a flood of bad
        frames does not flood the log)."""
        self.refused[kind] += 1
        n = self.refused[kind]
        if n == 1 or n % 100 == 0:
            logger.warning("NIXL's side channel %s dropped a message (%s; %d of this kind so far)",
                           _zmq_path(self.host, self.port), why, n)
