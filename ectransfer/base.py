"""The transport interface. Every transport implements both halves.

Everything a caller needs to know about a transport is asked of the transport
(its class attributes and methods below): no caller outside the transport's
own module and ``factory`` tests a transport's name or a descriptor's payload
name. A new transport is one module, its row in ``factory`` and its proto
message.

Handshake (both halves): the producer ``offer()``s each transport, the consumer
``probe(offer)``s it and returns a proof (raising ProtocolError when it cannot
use it, e.g. it cannot map the producer's shared memory), and the producer
``verify(proof)``s the consumer's choice. ``ectransfer.selection.choose`` picks
the consumer's best transport that proves usable.

Both halves: ``name`` (the registry's name, as in ``--transports``), ``kind``
(the proto enum) and ``in_place`` (the consumer reads the producer's memory).

Producer half, while the encoder's connector is built (its scheduler half):
    ``pool_priority``          of the transports offered, the one with the
                               highest priority makes the outbound pool
                               (``make_pool``; CUDA IPC: a device allocation);
                               the others are offered only if they
                               ``describes(pool)`` (``factory.make_producers``).
    ``build(pool, chunk_nbytes)``  the transport serving that pool.

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
    ``check_source(desc, proven)``  an ItemHeader's payload is this transport's
                               and, in place, lies in the memory the producer
                               proved in the handshake (``proven``, its offer).
    ``where(desc)``            (memory, offset) of an in-place item: the
                               producer's segment or pool it lies in.
    ``forget(memory)``         unmap that memory (its producer went away).
    ``release(offer)``         the stream whose handshake chose ``offer`` ended:
                               drop what its probe set up (NIXL: the producer's
                               remote agent).
    ``shared_mappings``        the mappings are process-wide (CUDA IPC), so the
                               transfer client leaves ``forget`` to the
                               connector, after vLLM's worker read them.
    ``for_service()``          the transport as the LM *service* process
                               checks an encoder with; a ``provisional`` one
                               only says it could work here (the handshake
                               stops before Select; the engine proves it).

Consumer worker half (vLLM's worker, in place only):
    ``load(desc, device)``     a copy of the item on ``device`` (flat uint8)
                               that the caller owns, finished when it returns;
                               the producer keeps the memory until the
                               scheduler half acks after the load.

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

from ectransfer.pool import Pool
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
    name: ClassVar[str]
    kind: ClassVar[int]
    in_place: ClassVar[bool] = False
    """The consumer reads the producer's memory itself (shm, CUDA IPC): the
    server holds the slot from the header until the consumer's Ack/Cancel."""
    pool_priority: ClassVar[int] = 0
    """Of the transports a producer offers, the one with the highest priority
    makes the outbound pool (``make_pool``)."""

    @classmethod
    def make_pool(cls, capacity: int, role: str) -> Pool | None:
        """A new outbound pool of ``capacity`` bytes, owned (and closed) by the
        caller; None (the default): this transport needs no pool of its own, and
        the factory makes its default one (``factory.make_producers``)."""
        return None

    @classmethod
    def describes(cls, pool: Pool) -> bool:
        """Whether this transport can serve items of ``pool`` (shm cannot
        describe device memory); one that cannot is not offered."""
        return True

    @classmethod
    def build(cls, pool: Pool, chunk_nbytes: int) -> ProducerTransport:
        """The transport serving ``pool`` (which the caller keeps owning);
        ``chunk_nbytes`` is for transports that send the bytes in chunks."""
        return cls(pool=pool)

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
    name: ClassVar[str]
    kind: ClassVar[int]
    payload: ClassVar[str]
    """The ``TensorDescriptor.payload`` field this transport reads."""
    in_place: ClassVar[bool] = False
    """``locate`` can hand out where the item lies instead of copying it."""
    shared_mappings: ClassVar[bool] = False
    """The memory it maps is mapped once per process and shared with vLLM's
    worker when that runs in the same process: the transfer client does not
    ``forget`` it; the connector does, after the worker's loads."""
    provisional: ClassVar[bool] = False
    """A stand-in (``for_service``) that can say whether the transport could
    work here but cannot prove it: a handshake with it stops before Select."""

    @classmethod
    def for_service(cls) -> ConsumerTransport:
        """The transport as the LM service process (outside the engine) checks
        an encoder with: by default the transport itself."""
        return cls()

    def check_source(self, desc: transfer_pb2.TensorDescriptor,
                     proven: transfer_pb2.TransportOffer | None) -> None:
        """An ItemHeader's descriptor on a stream that chose this transport:
        its payload must be this transport's; in-place transports also check
        that it lies in the memory the producer proved (``proven``: the chosen
        offer). Raises ProtocolError."""
        got = desc.WhichOneof("payload")
        if got != self.payload:
            raise ProtocolError(f"a {got} item on a stream that chose {self.name}")

    def where(self, desc: transfer_pb2.TensorDescriptor) -> tuple[str, int]:
        """(memory, offset) of an in-place item: the producer's segment or pool
        it lies in (what ``forget`` takes), and where in it."""
        raise ProtocolError("this transport cannot be read in place")

    def load(self, desc: transfer_pb2.TensorDescriptor, device: torch.device | str) -> torch.Tensor:
        """vLLM's worker: a flat uint8 copy of the in-place item on ``device``,
        owned by the caller and complete when this returns (the scheduler half
        acks after, which lets the producer free it). Raises ProtocolError."""
        raise ProtocolError("this transport cannot be read in place")

    def forget(self, memory: str) -> None:
        """Unmaps ``memory`` (a ``where`` name) of a producer that went away."""
        return None

    def release(self, offer: transfer_pb2.TransportOffer | None) -> None:
        """The stream whose handshake chose ``offer`` (its proven offer) ended: drop what the
        probe set up for it. Called once per stream by the transfer client, on its thread."""
        return None

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
