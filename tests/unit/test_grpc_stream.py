"""GRPC_CHUNKS transport: bytes in, chunks out, the same bits back."""

import pytest
import torch

from ectransfer import chunkwire, tensors
from ectransfer.grpc_stream import GrpcChunkConsumer, GrpcChunkProducer
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2
from tests.unit.helpers import assert_bit_identical, descriptor, random_bits, rebuild, special_values

pytestmark = pytest.mark.unit

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(0, 128), (1, 1), (16, 128), (1000, 1024)]
CHUNK_SIZES = [1000, 4 << 20]


def send(t: torch.Tensor, chunk_nbytes: int) -> torch.Tensor:
    """Producer describe/payload -> consumer receiver/feed; returns the rebuilt tensor."""
    data = tensors.as_bytes(t)
    desc = descriptor(t)
    producer = GrpcChunkProducer(chunk_nbytes)
    producer.describe(data, desc)
    # The wire bytes the producer sends, read back the way the consumer does.
    msgs = [chunkwire.deserialize(raw) for raw in producer.payload("item-1", data)]
    assert desc.WhichOneof("payload") == "chunks"
    assert desc.chunks.chunk_nbytes == chunk_nbytes
    assert len(msgs) == desc.chunks.num_chunks == -(-desc.nbytes // chunk_nbytes)
    assert all(m.chunk.identifier == "item-1" for m in msgs)
    assert all(len(m.chunk.data) == chunk_nbytes for m in msgs[:-1])

    dest = torch.empty(desc.nbytes, dtype=torch.uint8)
    receiver = GrpcChunkConsumer().receiver(desc, dest)
    assert receiver.complete == (desc.nbytes == 0)
    done = [receiver.feed(m.chunk) for m in msgs]
    assert done == [False] * (len(msgs) - 1) + [True] * bool(msgs)  # True exactly on the last chunk
    assert receiver.complete
    return rebuild(dest, desc)


@pytest.mark.parametrize("chunk_nbytes", CHUNK_SIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_identical(dtype, shape, chunk_nbytes):
    t = random_bits(shape, dtype, seed=10 * SHAPES.index(shape) + DTYPES.index(dtype))
    assert_bit_identical(send(t, chunk_nbytes), t)


@pytest.mark.parametrize("chunk_nbytes", [1, 3, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_and_negative_zero_survive(dtype, chunk_nbytes):
    t = special_values(dtype)
    out = send(t, chunk_nbytes)
    assert_bit_identical(out, t)
    assert torch.signbit(out[3]) and out[3] == 0  # -0.0 kept its sign
    assert torch.isnan(out[0]) and torch.isinf(out[1:3]).all()


@pytest.mark.parametrize(
    "make",
    [lambda b: b.t(), lambda b: b[:, ::3], lambda b: b[2:9, 5:70], lambda b: b.t()[::2]],
    ids=["transposed", "column-stride", "sub-block", "transposed-strided"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_tensors_round_trip(dtype, make):
    t = make(random_bits((16, 128), dtype, seed=7))
    assert not t.is_contiguous()
    out = send(t, 1000)
    assert out.is_contiguous()
    assert_bit_identical(out, t)


def _setup(nbytes: int = 3000, chunk_nbytes: int = 1000):
    t = torch.arange(nbytes, dtype=torch.uint8)
    desc = descriptor(t)
    GrpcChunkProducer(chunk_nbytes).describe(t, desc)
    msgs = [chunkwire.deserialize(raw).chunk for raw in GrpcChunkProducer(chunk_nbytes).payload("x", t)]
    return desc, msgs, torch.empty(nbytes, dtype=torch.uint8)


def test_out_of_order_chunk_raises():
    desc, msgs, dest = _setup()
    receiver = GrpcChunkConsumer().receiver(desc, dest)
    with pytest.raises(ProtocolError, match="offset 1000, expected 0"):
        receiver.feed(msgs[1])


def test_repeated_chunk_raises():
    desc, msgs, dest = _setup()
    receiver = GrpcChunkConsumer().receiver(desc, dest)
    receiver.feed(msgs[0])
    with pytest.raises(ProtocolError, match="expected 1000"):
        receiver.feed(msgs[0])
    assert not receiver.complete


def test_overrun_raises():
    desc, msgs, dest = _setup()
    receiver = GrpcChunkConsumer().receiver(desc, dest)
    too_long = transfer_pb2.Chunk(identifier="x", offset=0, data=bytes(desc.nbytes + 1))
    with pytest.raises(ProtocolError, match="overruns"):
        receiver.feed(too_long)
    for m in msgs:
        receiver.feed(m)
    with pytest.raises(ProtocolError, match="overruns"):
        receiver.feed(transfer_pb2.Chunk(identifier="x", offset=desc.nbytes, data=b"\0"))


@pytest.mark.parametrize("payload", ["shm", None])
def test_wrong_payload_kind_raises(payload):
    t = torch.zeros(8, dtype=torch.uint8)
    desc = descriptor(t)
    if payload == "shm":
        desc.shm.segment = "epd-x-1-ab"
    with pytest.raises(ProtocolError, match="inline-chunks"):
        GrpcChunkConsumer().receiver(desc, torch.empty(8, dtype=torch.uint8))


@pytest.mark.parametrize("dest_nbytes", [0, 2999, 3001])
def test_destination_of_the_wrong_size_raises(dest_nbytes):
    desc, _, _ = _setup()
    with pytest.raises(ProtocolError, match="destination has"):
        GrpcChunkConsumer().receiver(desc, torch.empty(dest_nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("chunk_nbytes", [0, -1])
def test_chunk_size_must_be_positive(chunk_nbytes):
    with pytest.raises(ValueError):
        GrpcChunkProducer(chunk_nbytes)
