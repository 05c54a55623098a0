"""The hand-rolled chunk codec produces and reads protobuf's exact bytes."""

import os

import pytest

from ectransfer import chunkwire
from epd.transfer.v1 import transfer_pb2


@pytest.mark.parametrize("ident,offset,data", [
    ("img-1", 0, b""), ("img-1", 0, b"x"), ("id-\u00e9", 4 << 20, os.urandom(1000)),
    ("", 1, os.urandom(300)), ("h" * 200, 2**40, os.urandom(4 << 20)),
])
def test_chunks_round_trip_both_ways_through_protobuf(ident, offset, data):
    ref = transfer_pb2.TransferServerMsg(chunk=transfer_pb2.Chunk(identifier=ident, offset=offset, data=data))
    raw = chunkwire.encode_chunk(ident, offset, memoryview(data))
    assert transfer_pb2.TransferServerMsg.FromString(raw) == ref
    got = chunkwire.deserialize(ref.SerializeToString())
    assert got.WhichOneof("msg") == "chunk"
    assert (got.chunk.identifier, got.chunk.offset, bytes(got.chunk.data)) == (ident, offset, data)


def test_other_messages_go_through_protobuf():
    header = transfer_pb2.TransferServerMsg(header=transfer_pb2.ItemHeader(identifier="a"))
    assert chunkwire.response_serializer(header) == header.SerializeToString()
    assert chunkwire.deserialize(header.SerializeToString()) == header


def test_a_received_chunk_views_the_buffer_without_copying():
    raw = transfer_pb2.TransferServerMsg(chunk=transfer_pb2.Chunk(identifier="a", data=b"abcd")).SerializeToString()
    view = chunkwire.deserialize(raw).chunk.data
    assert isinstance(view, memoryview) and view.obj is raw
