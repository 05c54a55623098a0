"""GRPC_CHUNKS: the transport that works anywhere.

The producer streams the slot's bytes in ``Chunk`` messages of ``chunk_nbytes``
(encoded and decoded by hand, ``ectransfer.chunkwire``, to save two copies)
(a few MiB: grpcio moves 1+ GB/s with 4 MiB chunks but only 0.2-0.5 GB/s as one
large message). The consumer writes each chunk straight into a destination
buffer it owns (inbound staging); nothing is reassembled in Python lists.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ectransfer import chunkwire
from ectransfer.base import ConsumerTransport, ProducerTransport, Receiver
from ectransfer.pool import Pool
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2

DEFAULT_CHUNK_NBYTES = 4 << 20


class GrpcChunkProducer(ProducerTransport):
    name = "grpc"
    kind = transfer_pb2.GRPC_CHUNKS

    @classmethod
    def build(cls, pool: Pool, chunk_nbytes: int) -> GrpcChunkProducer:
        return cls(chunk_nbytes=chunk_nbytes)  # reads whatever slot it is handed, in any pool

    def __init__(self, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> None:
        if chunk_nbytes <= 0:
            raise ValueError(f"chunk_nbytes must be > 0, got {chunk_nbytes}")
        self.chunk_nbytes = chunk_nbytes

    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None:
        n = data.numel()
        desc.chunks.chunk_nbytes = self.chunk_nbytes
        desc.chunks.num_chunks = (n + self.chunk_nbytes - 1) // self.chunk_nbytes

    def payload(self, identifier: str, data: torch.Tensor) -> Iterator[bytes]:
        # Each chunk is serialized here, by hand (``chunkwire``): one copy out of
        # the slot, straight into the wire bytes, while the slot is held; the
        # pool's memory stays owned by the producer until the consumer acks.
        if data.device.type != "cpu":  # a CUDA outbound pool: one device-to-host copy per item
            data = data.cpu()
        mv = memoryview(data.numpy())
        for off in range(0, len(mv), self.chunk_nbytes):
            yield chunkwire.encode_chunk(identifier, off, mv[off : off + self.chunk_nbytes])


class ChunkReceiver(Receiver):
    """Writes chunks, in order, into ``dest`` (a flat uint8 tensor the caller owns)."""

    def __init__(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> None:
        if dest.numel() != desc.nbytes:
            raise ProtocolError(f"destination has {dest.numel()} bytes, tensor needs {desc.nbytes}")
        self._dest = dest.numpy() if desc.nbytes else None
        self._expected = desc.nbytes
        self._received = 0

    @property
    def complete(self) -> bool:
        return self._received == self._expected

    def feed(self, chunk: transfer_pb2.Chunk) -> bool:
        n = len(chunk.data)
        if chunk.offset != self._received:
            raise ProtocolError(f"chunk at offset {chunk.offset}, expected {self._received}")
        if self._received + n > self._expected:
            raise ProtocolError(f"chunk overruns the tensor ({self._received + n} > {self._expected} bytes)")
        if n:
            self._dest[self._received : self._received + n] = memoryview(chunk.data)
        self._received += n
        return self.complete


class GrpcChunkConsumer(ConsumerTransport):
    name = "grpc"
    kind = transfer_pb2.GRPC_CHUNKS
    payload = "chunks"

    def receiver(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> Receiver:
        if desc.WhichOneof("payload") != "chunks":
            raise ProtocolError(f"expected an inline-chunks payload, got {desc.WhichOneof('payload')}")
        return ChunkReceiver(desc, dest)
