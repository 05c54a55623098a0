"""A Transfer producer that lies, for tests of what the consumer accepts.

``RogueProducer`` is the real server (``tests.support.loopback.Producer``: shm
outbound pool, OutboundStore, TransferService on a loopback port) whose
transports rewrite what they tell consumers: ``header`` edits each
ItemHeader's descriptor after the honest ``describe`` (shape, dtype, segment,
offset), ``offer`` edits the handshake's offers (where the shm probe points).
It accepts any proof and keeps every proof a consumer sent (``proofs``): what
a rogue would learn from the probe. ``secret_segment`` makes a segment that
is not the producer's, filled with bytes a consumer must never send back.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import torch

from ectransfer.base import ProducerTransport
from ectransfer.shm import SHM_DIR, ShmSegment
from epd.transfer.v1 import transfer_pb2
from tests.support.loopback import Producer


class Lying(ProducerTransport):
    """Wraps an honest producer transport; rewrites what it describes and offers."""

    def __init__(self, inner: ProducerTransport, header: Callable[[transfer_pb2.TensorDescriptor], None] | None,
                 offer: Callable[[transfer_pb2.TransportOffer], None] | None, proofs: list[bytes]) -> None:
        self.inner, self.header, self.edit_offer, self.proofs = inner, header, offer, proofs
        self.kind = inner.kind
        self.in_place = inner.in_place

    def offer(self) -> transfer_pb2.TransportOffer:
        o = self.inner.offer()
        if self.edit_offer is not None:
            self.edit_offer(o)
        return o

    def verify(self, proof: bytes, challenge: bytes) -> bool:
        self.proofs.append(bytes(proof))
        return True

    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None:
        self.inner.describe(data, desc)
        if self.header is not None:
            self.header(desc)

    def payload(self, identifier: str, data: torch.Tensor):
        return self.inner.payload(identifier, data)

    def close(self) -> None:
        self.inner.close()


class RogueProducer:
    def __init__(self, header=None, offer=None, transports=("shm", "grpc"), **kw) -> None:
        self.proofs: list[bytes] = []
        self._real = Producer(transports=transports, **kw)
        ts = self._real.servicer.transports
        for kind in list(ts):
            ts[kind] = Lying(ts[kind], header, offer, self.proofs)
        self.store, self.pool, self.endpoint = self._real.store, self._real.pool, self._real.endpoint

    def close(self) -> None:
        self._real.close()


def secret_segment(name: str | None = None, nbytes: int = 4096) -> tuple[ShmSegment, bytes]:
    """A segment the rogue does not own (named like vLLM's ``psm_*`` unless
    ``name`` is given), filled with random bytes; the caller closes it."""
    seg = ShmSegment.create(name or f"psm_{secrets.token_hex(4)}", nbytes)
    secret = secrets.token_bytes(nbytes)
    seg.buffer.copy_(torch.frombuffer(bytearray(secret), dtype=torch.uint8))
    return seg, secret


def fifo_at(name: str) -> str:
    """A FIFO at /dev/shm/``name`` (an open O_RDONLY on it blocks until a writer comes)."""
    path = os.path.join(SHM_DIR, name)
    os.mkfifo(path, 0o600)
    return path


def release_fifo(path: str) -> None:
    """Unblocks whatever still waits in an open of the FIFO, then removes it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only if a reader is blocked there
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
