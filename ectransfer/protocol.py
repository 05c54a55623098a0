"""The Transfer protocol: per-item states, legal transitions, compatibility.

One ``Transfer`` stream per (consumer, producer) pair carries many items::

    consumer                           producer
    Hello(compat, transports)   --->
                                <---   HelloReply(compat, transport)   | FAILED_PRECONDITION
    Reserve(id, claim, max_nbytes) --->  (waits until a copy is held; the claim joins it)
                                <---   ItemHeader(id, descriptor, copy) | ItemError(id)
                                <---   Chunk(id, offset, bytes) ...    (GRPC_CHUNKS only)
    Ack(id, claim, copy) | Cancel(id, claim) ---> the claim is settled (``ectransfer.outbound``)

States are polled, never raised across vLLM's engine step (SGLang's KVPoll
idea): the consumer connector asks ``state`` each scheduler step.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ectransfer.fingerprint import model_fingerprint
from epd.transfer.v1 import transfer_pb2

CLIENT_KEEPALIVE_S = 30.0
"""Seconds between the consumer channel's HTTP/2 pings (the producer's server
accepts pings this often, ``TransferLimits.server_options``)."""

# Both ends of the Transfer stream: chunks are a few MiB, well under the limit.
# Keepalive pings (the server replaces these with its own, ``TransferLimits``):
# a producer that vanished without closing the connection (host gone, process
# stopped) fails the consumer's stream within about 40 s, not never. Pings
# continue on a stream with no data (an LM waiting for encodes).
TRANSFER_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", int(CLIENT_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # any unacked ping, not only keepalive's (default 1 min)
    ("grpc.http2.max_pings_without_data", 0),
]


class TransferState(enum.Enum):
    RESERVED = "reserved"    # consumer holds inbound space, Reserve sent
    RECEIVING = "receiving"  # header arrived, bytes are landing
    LANDED = "landed"        # readable: in our staging (acked), or in place in the producer's memory (held for us)
    LOST = "lost"            # landed in place, then its stream closed before vLLM took it (the scheduler fails it)
    LOADING = "loading"      # vLLM took it: the worker loads it this step (the client leaves it alone)
    DONE = "done"            # injected into vLLM's encoder cache and acked
    FAILED = "failed"        # error from the producer, a broken stream or a timeout
    CANCELLED = "cancelled"  # not needed any more (prefix cache, abort)

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)


_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.RESERVED: frozenset(
        {TransferState.RECEIVING, TransferState.LANDED, TransferState.FAILED, TransferState.CANCELLED}
    ),
    TransferState.RECEIVING: frozenset({TransferState.LANDED, TransferState.FAILED, TransferState.CANCELLED}),
    TransferState.LANDED: frozenset(
        {TransferState.LOADING, TransferState.LOST, TransferState.FAILED, TransferState.CANCELLED}
    ),
    # Taken anyway if vLLM was told it is cached before the loss (the producer keeps the memory a lease).
    TransferState.LOST: frozenset({TransferState.LOADING, TransferState.FAILED, TransferState.CANCELLED}),
    TransferState.LOADING: frozenset({TransferState.DONE}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.CANCELLED: frozenset(),
}


class ProtocolError(Exception):
    """A peer broke the protocol (illegal transition, bad chunk, bad header)."""


class CompatError(Exception):
    """The two ends disagree on model, dtype, width or vLLM version."""


@dataclass
class ItemTransfer:
    """Consumer-side record of one item moving through the protocol."""

    identifier: str
    max_nbytes: int
    state: TransferState = TransferState.RESERVED
    error: str | None = None
    changed_at: float = 0.0
    """``time.perf_counter()`` of the last transition (benchmarks read it)."""
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False, compare=False)
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Called (on the thread that moved it) after every transition: the consumer
    connector's wake-up for a scheduler that waits for embeddings."""

    def advance(self, new: TransferState, error: str | None = None) -> None:
        if not self.try_advance(new, error):
            raise ProtocolError(f"item {self.identifier}: illegal transition {self.state.value} -> {new.value}")

    def try_advance(self, new: TransferState, error: str | None = None) -> bool:
        """``advance`` if legal from the current state, atomically; False if
        another thread moved the item first (e.g. the client failed it)."""
        with self._changed:
            if new not in _ALLOWED[self.state]:
                return False
            if error is not None:
                self.error = error
            self.state = new
            self.changed_at = time.perf_counter()
            self._changed.notify_all()
        if self.on_change is not None:
            self.on_change()
        return True

    def hold(self) -> threading.Condition:
        """The lock every transition takes (re-entrant): ``with transfer.hold():`` makes a
        check and the work that depends on it atomic with respect to the other thread."""
        return self._changed

    def wait_for(self, states: set[TransferState], timeout: float | None = None) -> bool:
        """Blocks until the state is one of ``states`` (tests and benchmarks;
        vLLM's scheduler polls ``state`` instead)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.state in states, timeout)

    def fail(self, error: str) -> None:
        """Moves to FAILED unless terminal or being loaded (idempotent on teardown)."""
        if not self.state.terminal:
            self.try_advance(TransferState.FAILED, error)


def make_compat(*, vllm_version: str, model: str, dtype: str, embed_width: int) -> transfer_pb2.CompatInfo:
    """The compatibility info both ends of a Transfer stream exchange. Its hash
    covers the vLLM version, dtype, embedding width and the model's identity
    (``ectransfer.fingerprint``: config, processor and tokenizer files, and the
    weights' headers and samples, not their full bytes), so two directories
    holding the same model agree and a fine-tune with the same config does not."""
    fingerprint = model_fingerprint(model)
    digest = hashlib.sha256(
        json.dumps([vllm_version, fingerprint, dtype, int(embed_width)]).encode()
    ).hexdigest()
    return transfer_pb2.CompatInfo(
        hash=digest, vllm_version=vllm_version, model=model, dtype=dtype, embed_width=int(embed_width)
    )


def check_compat(local: transfer_pb2.CompatInfo, remote: transfer_pb2.CompatInfo) -> None:
    """Raises CompatError naming every field that differs."""
    if local.hash == remote.hash:
        return
    diffs = [
        f"{name}: here {getattr(local, name)!r}, peer {getattr(remote, name)!r}"
        for name in ("model", "dtype", "embed_width", "vllm_version")
        if getattr(local, name) != getattr(remote, name)
    ] or [f"model files differ: config, weights or tokenizer (here {local.model!r}, peer {remote.model!r})"]
    raise CompatError("encoder and LM are incompatible: " + "; ".join(diffs))


def new_event_loop():
    """The event loop for the transfer threads: uvloop when installed (vLLM
    depends on it), which roughly halves per-message latency, else asyncio's."""

    if os.environ.get("EPD_NO_UVLOOP") != "1":
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


async def call_status(call, e: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The call's own status: a producer that refuses a stream at once
    (UNAUTHENTICATED, RESOURCE_EXHAUSTED) can end it while our request
    writer still writes, and grpc then raises INTERNAL for the write."""
    if call is not None and e.code() == grpc.StatusCode.INTERNAL:
        try:
            code = await asyncio.wait_for(call.code(), 1.0)
            if code not in (None, grpc.StatusCode.OK):
                return code, await call.details()
        except Exception:  # noqa: BLE001 - keep the error we have
            pass
    return e.code(), e.details()
