"""The transport interface. Every transport implements both halves.

Handshake (both halves): the producer ``offer()``s each transport, the consumer
``probe(offer)``s it and returns a proof (raising ProtocolError when it cannot
use it, e.g. it cannot map the producer's shared memory), and the producer
``verify(proof)``s the consumer's choice. ``ectransfer.selection.choose`` picks
the consumer's best transport that proves usable.

Producer half (encoder engine process, on the transfer server's threads):
    ``describe(data, desc)``   fill ``desc``'s payload oneof for one item whose
                               bytes are ``data`` (a flat uint8 view of an
                               outbound-pool slot). The producer keeps owning
                               the slot until the consumer acks or cancels.
    ``payload(id, data)``      messages that follow the ItemHeader (chunks for
                               GRPC_CHUNKS; nothing for shm and CUDA IPC).

Consumer half (LM engine process, on the transfer client's thread):
    ``receiver(desc, dest)``   a ``Receiver`` that lands the item's bytes into
                               ``dest``, a flat uint8 buffer the consumer owns
                               (its inbound staging); ``feed`` takes the
                               following messages and returns True when every
                               byte has landed. Transports whose bytes are
                               readable at once (shm) are complete on creation.
    ``close()``                drop cached mappings (pools mapped once per peer).

Failures are raised as ``ProtocolError`` inside the transfer threads and turned
into a FAILED item state there; nothing raises across vLLM's engine step.
"""

from __future__ import annotations

import hashlib
import hmac
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch

from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2


class Receiver(ABC):
    """Lands one item's bytes; created per item by ``ConsumerTransport.receiver``."""

    @property
    @abstractmethod
    def complete(self) -> bool: ...

    def feed(self, chunk: transfer_pb2.Chunk) -> bool:
        """Takes one payload message; returns True once complete."""
        raise ProtocolError("this transport sends no chunks")


class Landed(Receiver):
    """For transports that copy the whole item while creating the receiver (shm, CUDA IPC)."""

    @property
    def complete(self) -> bool:
        return True


def seal_proof(read: bytes, challenge: bytes) -> bytes:
    """What a consumer sends back for a probe: SHA-256 of the producer's
    per-stream ``challenge`` (``TransportOffer.challenge``) and the bytes it
    read. It shows the consumer mapped the segment without handing the bytes
    to whoever asked (a rogue producer could aim a probe at another producer's
    segment), and it is good for that one stream only (no replay elsewhere)."""
    return hashlib.sha256(b"epd-probe-v1" + challenge + read).digest()


def proof_matches(proof: bytes, nonce: bytes, challenge: bytes) -> bool:
    """The producer's check of ``seal_proof(nonce, challenge)`` (constant-time)."""
    return bool(challenge) and hmac.compare_digest(proof, seal_proof(nonce, challenge))


class ProducerTransport(ABC):
    kind: ClassVar[int]
    in_place: ClassVar[bool] = False
    """The consumer reads the producer's memory itself (shm, CUDA IPC): the
    server holds the slot from the header until the consumer's Ack/Cancel."""

    def offer(self) -> transfer_pb2.TransportOffer:
        return transfer_pb2.TransportOffer(transport=self.kind)

    def verify(self, proof: bytes, challenge: bytes) -> bool:
        """Whether ``proof`` answers this transport's probe for the stream that
        sent ``challenge`` (transports without a probe accept anything)."""
        return True

    @abstractmethod
    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None: ...

    def payload(self, identifier: str, data: torch.Tensor) -> Iterator[transfer_pb2.TransferServerMsg]:
        return iter(())

    def close(self) -> None:
        return None


class ConsumerTransport(ABC):
    kind: ClassVar[int]
    in_place: ClassVar[bool] = False
    """``locate`` can hand out where the item lies instead of copying it."""

    def locate(self, desc: transfer_pb2.TensorDescriptor) -> None:
        """In-place transports: validate ``desc`` (the range lies inside memory
        this process can map) without copying; raises ProtocolError. The reader
        copies it later and acks after (``TransferClient.ack``)."""

        raise ProtocolError("this transport cannot be read in place")

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        """The proof that this consumer can use ``offer`` (raises ProtocolError if not)."""
        return b""

    @abstractmethod
    def receiver(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> Receiver: ...

    def close(self) -> None:
        return None
