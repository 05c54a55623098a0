"""Chunk messages on the gRPC stream without two of their copies.

A ``Chunk`` built the usual way costs the producer two copies of its data
(``bytes(...)`` into the message, then ``SerializeToString``) and the consumer
one more (``FromString`` copies the bytes field out of the received buffer)
before the one copy into staging. Here the producer encodes a chunk by hand
(``encode_chunk``: the wire bytes of ``TransferServerMsg{chunk: Chunk{identifier,
offset, data}}``, with the data joined in by one copy) and yields those bytes,
which the Transfer method's response serializer passes through; the
consumer's response deserializer parses a chunk by hand into a ``ChunkView``
whose ``data`` is a zero-copy ``memoryview`` of the received buffer. Every other message goes through
protobuf as usual, and the bytes on the wire are exactly protobuf's, so
either end may be a plain protobuf peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from epd.transfer.v1 import transfer_pb2

_MSG = transfer_pb2.TransferServerMsg
_CHUNK_FIELD = _MSG.DESCRIPTOR.fields_by_name["chunk"].number
_ID = transfer_pb2.Chunk.DESCRIPTOR.fields_by_name["identifier"].number
_OFFSET = transfer_pb2.Chunk.DESCRIPTOR.fields_by_name["offset"].number
_DATA = transfer_pb2.Chunk.DESCRIPTOR.fields_by_name["data"].number


def _varint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"varint of a negative number ({n})")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


@dataclass
class ChunkView:
    """A received chunk: ``data`` views the received buffer (no copy)."""

    identifier: str
    offset: int
    data: memoryview


class ChunkMsg:
    """Duck-types the ``TransferServerMsg`` the client reads (``WhichOneof``, ``chunk``)."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: ChunkView) -> None:
        self.chunk = chunk

    def WhichOneof(self, name: str) -> str:
        return "chunk"


def encode_chunk(identifier: str, offset: int, data: memoryview) -> bytes:
    """The wire bytes of one chunk, with one copy of ``data`` (a view of the
    producer's slot, which it holds while encoding)."""
    ident = identifier.encode()
    inner = bytearray()
    if ident:
        inner += _varint(_ID << 3 | 2) + _varint(len(ident)) + ident
    if offset:
        inner += _varint(_OFFSET << 3) + _varint(offset)
    n = len(data)
    if n:
        inner += _varint(_DATA << 3 | 2) + _varint(n)
    head = _varint(_CHUNK_FIELD << 3 | 2) + _varint(len(inner) + n) + bytes(inner)
    return b"".join((head, data)) if n else head


def deserialize(raw: bytes):
    """Response deserializer of the Transfer method (consumer): a ChunkMsg for
    a chunk, else the protobuf message."""
    buf = memoryview(raw)
    try:
        tag, pos = _read_varint(buf, 0)
        if tag != (_CHUNK_FIELD << 3 | 2):
            return _MSG.FromString(raw)
        length, pos = _read_varint(buf, pos)
        end = pos + length
        if end != len(buf):
            return _MSG.FromString(raw)  # more than one field: leave it to protobuf
        ident, offset, data = "", 0, buf[0:0]
        while pos < end:
            key, pos = _read_varint(buf, pos)
            field, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _read_varint(buf, pos)
                if field == _OFFSET:
                    offset = value
            elif wire == 2:
                n, pos = _read_varint(buf, pos)
                if pos + n > end:
                    raise ValueError("truncated field")
                if field == _ID:
                    ident = bytes(buf[pos:pos + n]).decode()
                elif field == _DATA:
                    data = buf[pos:pos + n]
                pos += n
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"wire type {wire}")
        if pos != end:
            raise ValueError("truncated chunk")
        return ChunkMsg(ChunkView(ident, offset, data))
    except ValueError:
        return _MSG.FromString(raw)  # protobuf raises its own DecodeError for real garbage


def response_serializer(msg) -> bytes:
    """Response serializer of the Transfer method (producer): chunks arrive
    already serialized (``GrpcChunkProducer.payload``), messages do not."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


TRANSFER_SERVICE = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"].full_name
TRANSFER_METHOD = f"/{TRANSFER_SERVICE}/Transfer"
# Where the Transfer service lived before the library owned its protocol (epd-serve 0.3). A producer
# answers it with a version error, so a consumer of that age learns why rather than UNIMPLEMENTED.
LEGACY_TRANSFER_SERVICE = "epd.encoder.v1.TransferService"
VERSION_MISMATCH = (f"this producer serves {TRANSFER_SERVICE} (epd-serve 0.4 and later), not "
                    f"{LEGACY_TRANSFER_SERVICE}: the consumer runs an older epd-serve; run one version "
                    f"across the deployment")


async def _legacy(request, context):
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, VERSION_MISMATCH)


def add_transfer_service(servicer, server) -> None:
    """``add_TransferServiceServicer_to_server`` (every method of the proto's
    service, read from its descriptor) with the Transfer method's response
    serializer swapped for ``response_serializer``, and the service's old name
    answered with a version error (``LEGACY_TRANSFER_SERVICE``)."""
    handlers = {}
    for m in transfer_pb2.DESCRIPTOR.services_by_name["TransferService"].methods:  # every method the proto has
        request, reply = getattr(transfer_pb2, m.input_type.name), getattr(transfer_pb2, m.output_type.name)
        make = (grpc.stream_stream_rpc_method_handler if m.client_streaming and m.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=request.FromString,
                                response_serializer=response_serializer if m.name == "Transfer"
                                else reply.SerializeToString)
    legacy = {"Transfer": grpc.stream_stream_rpc_method_handler(_legacy),
              "Stats": grpc.unary_unary_rpc_method_handler(_legacy)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRANSFER_SERVICE, handlers),
                                     grpc.method_handlers_generic_handler(LEGACY_TRANSFER_SERVICE, legacy)))


def transfer_call(channel):
    """The Transfer method on ``channel`` with ``deserialize`` for responses."""
    return channel.stream_stream(TRANSFER_METHOD, request_serializer=transfer_pb2.TransferClientMsg.SerializeToString,
                                 response_deserializer=deserialize)
