"""The CUDA IPC consumer's checks on the refs a producer sends, without a GPU:
the arithmetic of ``check_range`` and ``locate`` against a pool registered as
this process's own (its buffer is then read directly, no handle is opened)."""

import uuid

import pytest
import torch

from ectransfer import cuda_ipc
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2

pytestmark = pytest.mark.unit

POOL = 1024


@pytest.fixture
def pool():
    """A stand-in for a CudaPool this process exported: 1 KiB of host memory."""
    fake = type("FakePool", (), {})()
    fake.pool_id, fake.handle, fake.capacity = uuid.uuid4().hex, b"h" * 64, POOL
    fake.buffer = torch.zeros(POOL, dtype=torch.uint8)
    cuda_ipc.register_local(fake)
    yield fake
    cuda_ipc._LOCAL.pop(fake.pool_id, None)


def desc(pool, offset: int, nbytes: int, pool_nbytes: int = POOL, handle: bytes | None = None):
    ref = transfer_pb2.CudaIpcRef(handle=pool.handle if handle is None else handle, pool_id=pool.pool_id,
                                offset=offset, pool_nbytes=pool_nbytes)
    return transfer_pb2.TensorDescriptor(shape=[], dtype=transfer_pb2.UINT8, nbytes=nbytes, cuda_ipc=ref)


@pytest.mark.parametrize("offset, nbytes", [(0, POOL), (POOL - 16, 16), (POOL, 0)])
def test_a_range_inside_the_pool_is_located(pool, offset, nbytes):
    assert cuda_ipc.CudaIpcConsumer().locate(desc(pool, offset, nbytes)) is pool.buffer


@pytest.mark.parametrize("offset, nbytes", [(POOL - 15, 16), (POOL + 1, 0), (2**64 - 1, 16), (2**63, 2**63)])
def test_a_range_past_the_pool_is_refused(pool, offset, nbytes):
    with pytest.raises(ProtocolError, match="outside"):
        cuda_ipc.CudaIpcConsumer().locate(desc(pool, offset, nbytes))


def test_a_ref_that_claims_a_larger_pool_than_the_mapping_is_refused(pool):
    # The claimed size would admit the range; the memory mapped here ends at 1 KiB.
    with pytest.raises(ProtocolError):
        cuda_ipc.CudaIpcConsumer().locate(desc(pool, 2000, 16, pool_nbytes=1 << 40))


def test_a_ref_that_names_a_known_pool_with_another_handle_is_refused(pool):
    with pytest.raises(ProtocolError, match="another handle"):
        cuda_ipc.CudaIpcConsumer().locate(desc(pool, 0, 16, handle=b"x" * 64))


@pytest.mark.parametrize("offset, nbytes, mapped, ok", [
    (0, 16, None, True), (POOL - 16, 16, POOL, True), (POOL - 16, 16, POOL - 1, False),
    (2**64 - 1, 1, None, False), (0, POOL + 1, None, False),
])
def test_check_range_uses_the_mapped_size_when_given(offset, nbytes, mapped, ok):
    ref = transfer_pb2.CudaIpcRef(pool_id="p", offset=offset, pool_nbytes=POOL)
    if ok:
        cuda_ipc.check_range(ref, nbytes, mapped)
    else:
        with pytest.raises(ProtocolError, match="outside"):
            cuda_ipc.check_range(ref, nbytes, mapped)


def test_without_a_cuda_driver_the_allocation_size_query_is_a_protocol_error(monkeypatch):
    """On a host with no libcuda the real-size query fails as a refused ref, never a crash."""
    monkeypatch.setattr(cuda_ipc, "_DRIVER", [])
    monkeypatch.setattr(cuda_ipc.ctypes.util, "find_library", lambda name: "libcuda-not-here.so")
    with pytest.raises(ProtocolError, match="cannot query"):
        cuda_ipc.allocation_nbytes(0x1000)
