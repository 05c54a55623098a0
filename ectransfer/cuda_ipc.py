"""CUDA_IPC: one device-to-device copy between processes on one GPU node.

Producer: ``CudaPool`` is one raw ``cudaMalloc`` (through cupy, so the pointer
is the allocation's base, which CUDA IPC requires; the PyTorch caching
allocator hands out sub-ranges of larger segments). Its IPC handle is exported
once; an item travels as (handle, pool_id, offset, nbytes). The producer owns
the pool and every slot until the consumer acks.

Consumer: maps each (producer, pool) once -- ``cudaIpcOpenMemHandle`` costs
up to hundreds of milliseconds -- with its own device current, so no context
is created on the producer's device (peer access instead), copies the range
into its destination on its current stream, records an event and waits on it
before reporting the item landed: the ack that lets the producer reuse the
slot is stream-ordered after the copy.

Selection: the producer keeps a nonce in a small slot of the pool; a consumer
proves it can use CUDA IPC by opening the handle and reading the nonce back.

The consumer does not trust the refs a producer sends: a pool is mapped at
the size of the allocation the handle really opens (``allocation_nbytes``:
the driver's ``cuMemGetAddressRange``), never the size a ref claims; a ref
that claims more than that is refused, a later ref that names the same pool
with another handle or size is refused, and every range is checked against
the mapped size (``check_range``) before any copy: an out-of-range device
read would poison the LM's CUDA context for every request.
cupy is imported lazily; importing ``ectransfer`` never loads CUDA libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import secrets
import threading
import uuid

import torch

from ectransfer.base import ConsumerTransport, Landed, ProducerTransport, Receiver, proof_matches, seal_proof
from ectransfer.factory import cuda_ipc_usable
from ectransfer.pool import ALIGNMENT, Pool
from ectransfer.pool import check_range as _check_range
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ProtocolError(f"CUDA IPC needs cupy (pip install cupy-cuda12x): {e}") from None
    return cupy


def _device_uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - informational only
        return f"cuda:{index}"


class CudaPool(Pool):
    """A Pool whose buffer is one raw device allocation, exported once."""

    def __init__(self, capacity: int, device: int | None = None, alignment: int = ALIGNMENT) -> None:
        cp = _cupy()
        self.device = torch.cuda.current_device() if device is None else device
        with cp.cuda.Device(self.device):
            self._mem = cp.cuda.Memory(capacity)  # freed when this object goes
            self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._mem.ptr))
        self.pool_id = uuid.uuid4().hex
        self.device_uuid = _device_uuid(self.device)
        super().__init__(capacity, alignment)
        register_local(self)

    def _make_buffer(self, capacity: int) -> torch.Tensor:
        cp = _cupy()
        arr = cp.ndarray((capacity,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(self._mem, 0))
        return torch.as_tensor(arr, device=f"cuda:{self.device}")

    def ref(self, offset: int) -> transfer_pb2.CudaIpcRef:
        return transfer_pb2.CudaIpcRef(handle=self.handle, pool_id=self.pool_id, device_uuid=self.device_uuid,
                                     offset=offset, pool_nbytes=self.capacity)

    def close(self) -> None:
        _LOCAL.pop(self.pool_id, None)
        super().close()
        self._mem = None


class CudaIpcProducer(ProducerTransport):
    name = "cuda_ipc"
    kind = transfer_pb2.CUDA_IPC
    in_place = True
    pool_priority = 2
    """Offered at all, it puts the outbound pool on the GPU (gRPC chunks still
    serve remote LMs, one device-to-host copy per item; shm cannot describe
    device memory, so it is not offered)."""
    NONCE_NBYTES = 16

    @classmethod
    def make_pool(cls, capacity: int, role: str) -> CudaPool:
        return CudaPool(capacity)

    @classmethod
    def describes(cls, pool: Pool) -> bool:
        return isinstance(pool, CudaPool)

    def __init__(self, pool: CudaPool) -> None:
        self.pool = pool
        self._nonce = secrets.token_bytes(self.NONCE_NBYTES)
        self._probe = pool.alloc(self.NONCE_NBYTES)
        pool.view(self._probe).copy_(torch.frombuffer(bytearray(self._nonce), dtype=torch.uint8))
        torch.cuda.synchronize(pool.device)

    def offer(self) -> transfer_pb2.TransportOffer:
        return transfer_pb2.TransportOffer(transport=self.kind, cuda_probe=self.pool.ref(self._probe.offset),
                                          cuda_probe_nbytes=self.NONCE_NBYTES)

    def verify(self, proof: bytes, challenge: bytes) -> bool:
        return proof_matches(proof, self._nonce, challenge)

    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None:
        offset = data.data_ptr() - self.pool.buffer.data_ptr() if data.numel() else 0
        desc.cuda_ipc.CopyFrom(self.pool.ref(offset))


_DRIVER: list = []


def _driver():
    """libcuda (the driver API), loaded once; cupy does not expose ``cuMemGetAddressRange``."""
    if not _DRIVER:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        lib = ctypes.CDLL(name)
        fn = lib.cuMemGetAddressRange_v2
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        _DRIVER.append(fn)
    return _DRIVER[0]


def allocation_nbytes(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation that contains ``ptr``, as the driver
    knows it (``cuMemGetAddressRange``): for an opened IPC handle, the real size of
    the producer's allocation, whatever its refs claim. Needs a current context
    on the device (the caller's ``cp.cuda.Device``). Raises ProtocolError."""
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    try:
        err = _driver()(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    except OSError as e:  # no libcuda in this process
        raise ProtocolError(f"cannot query CUDA allocation size: {e}") from None
    if err != 0:
        raise ProtocolError(f"cuMemGetAddressRange failed with CUDA error {err}")
    return base.value, size.value


class _Mapped:
    """One opened foreign pool: ``nbytes`` is the allocation's real size (what a copy
    may read), ``claimed`` the size the first ref gave (every later ref must repeat it)."""

    def __init__(self, ptr: int, nbytes: int, device: int, handle: bytes, claimed: int) -> None:
        cp = _cupy()
        self.ptr = ptr
        self.handle = handle
        self.claimed = claimed
        mem = cp.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device)
        arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        self.buffer = torch.as_tensor(arr, device=f"cuda:{device}")


# Process-wide, so the transfer client's probe and the connector's worker half
# share one mapping per pool when they live in one process (vLLM's
# single-process executor): cudaIpcOpenMemHandle is expensive, and a handle
# may be opened only once per process.
_MAPPED: dict[str, _Mapped] = {}
_LOCAL: dict[str, CudaPool] = {}  # pools this process exported: never opened here
_LOCK = threading.Lock()
_OPENED = [0]


def register_local(pool: CudaPool) -> None:
    """Marks ``pool`` as this process's: a reader here uses it directly."""
    _LOCAL[pool.pool_id] = pool


def open_count() -> int:
    """Handles this process opened (once per foreign pool): tests assert it."""
    return _OPENED[0]


def mapping(ref: transfer_pb2.CudaIpcRef, device: int | None = None) -> torch.Tensor:
    """The whole pool ``ref`` points into, as a flat uint8 CUDA tensor, opened
    once per process on ``device`` (default: the current one), so no context is
    created on the producer's device (peer access instead)."""
    local = _LOCAL.get(ref.pool_id)
    if local is not None:
        _check_same_pool(ref, local.handle, local.capacity)
        return local.buffer
    with _LOCK:
        m = _MAPPED.get(ref.pool_id)
        if m is not None:
            _check_same_pool(ref, m.handle, m.claimed)
        else:
            if ref.pool_nbytes <= 0:
                raise ProtocolError(f"CUDA IPC pool {ref.pool_id} claims {ref.pool_nbytes} bytes")
            cp = _cupy()
            dev = torch.cuda.current_device() if device is None else device
            try:
                with cp.cuda.Device(dev):
                    ptr = cp.cuda.runtime.ipcOpenMemHandle(ref.handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            except Exception as e:  # noqa: BLE001 - another namespace, no peer access, no driver
                raise ProtocolError(f"cannot open CUDA IPC handle of pool {ref.pool_id}: {e}") from None
            try:
                with cp.cuda.Device(dev):
                    base, real = allocation_nbytes(ptr)
                if base != ptr or ref.pool_nbytes > real:
                    raise ProtocolError(f"CUDA IPC pool {ref.pool_id} claims {ref.pool_nbytes} bytes; the "
                                        f"allocation its handle opens has {real} (base {base:#x}, mapped {ptr:#x})")
            except ProtocolError:
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
                raise
            # Mapped at the allocation's real size: a copy can never read past it, whatever a ref says.
            m = _MAPPED[ref.pool_id] = _Mapped(ptr, real, dev, bytes(ref.handle), ref.pool_nbytes)
            _OPENED[0] += 1
    return m.buffer


def _check_same_pool(ref: transfer_pb2.CudaIpcRef, handle: bytes, nbytes: int) -> None:
    """A ref naming a pool already known here must carry that pool's handle
    and size: a pool id alone must not reach another producer's memory."""
    if ref.handle != handle or ref.pool_nbytes != nbytes:
        raise ProtocolError(f"CUDA IPC ref names pool {ref.pool_id} with another handle or size "
                            f"({ref.pool_nbytes} bytes; mapped: {nbytes})")


def check_range(ref: transfer_pb2.CudaIpcRef, nbytes: int, mapped_nbytes: int | None = None) -> None:
    """``nbytes`` at ``ref.offset`` lie inside the pool: inside
    ``mapped_nbytes`` (the size of this process's mapping, which is what a
    copy reads) when given, and always inside the size the ref claims.
    Raises ProtocolError; pure arithmetic, no CUDA."""
    what = f"CUDA IPC pool {ref.pool_id}"
    _check_range(ref.offset, nbytes, ref.pool_nbytes, what)
    if mapped_nbytes is not None:
        _check_range(ref.offset, nbytes, mapped_nbytes, what + " (as mapped here)")


def _current_raw_stream(device: int) -> int:
    """The handle of ``device``'s current stream (whatever stream the caller, vLLM's
    worker say, made current): through torch's C binding, a few microseconds
    cheaper per call than building a ``torch.cuda.Stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _copy_and_wait(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies flat ``src`` into ``dst`` on the current stream of ``dst``'s device
    and waits for it (a stream synchronize: the work queued before on that
    stream, and the copy), so the report or ack that follows is ordered after
    the copy. Device to device (the CUDA IPC case) is one ``cudaMemcpyAsync``
    through cupy: measured on an H100 (bench/results/transfer-cuda.json's
    machine), torch's ``copy_`` plus an event cost 45 us per item on an asyncio
    thread that had been idle for 400 us, this 24 us. Anything else (host memory
    on one side, a strided view) is torch's ``copy_``."""
    n = dst.numel() * dst.element_size()
    if (dst.is_cuda and src.is_cuda and dst.dtype == src.dtype and dst.numel() == src.numel()
            and dst.is_contiguous() and src.is_contiguous()):
        rt = _cupy().cuda.runtime
        stream = _current_raw_stream(dst.device.index)
        rt.memcpyAsync(dst.data_ptr(), src.data_ptr(), n, rt.memcpyDefault, stream)
        rt.streamSynchronize(stream)
        return
    dst.copy_(src, non_blocking=True)  # D2H / H2D with host memory on one side
    done = torch.cuda.Event()
    done.record()
    done.synchronize()


def copy_out(ref: transfer_pb2.CudaIpcRef, nbytes: int, dest: torch.Tensor) -> None:
    """Copies ``nbytes`` at ``ref`` into ``dest`` (flat uint8, any device) on
    the current stream and waits for the copy: once this returns the producer
    may reuse the range (the caller acks after)."""
    buf = mapping(ref)
    check_range(ref, nbytes, buf.numel())
    if nbytes:
        _copy_and_wait(dest, buf[ref.offset : ref.offset + nbytes])


def copy_in(ref: transfer_pb2.CudaIpcRef, src: torch.Tensor) -> None:
    """The producer's worker: writes ``src`` (flat uint8) at ``ref`` and waits,
    so the slot is complete before it is reported (and then served)."""
    buf = mapping(ref)
    check_range(ref, src.numel(), buf.numel())
    if src.numel():
        _copy_and_wait(buf[ref.offset : ref.offset + src.numel()], src)


def forget(pool_id: str) -> None:
    """Closes the mapping of a pool whose producer went away."""
    with _LOCK:
        m = _MAPPED.pop(pool_id, None)
    if m is not None:
        try:
            _cupy().cuda.runtime.ipcCloseMemHandle(m.ptr)
        except Exception:  # noqa: BLE001 - the producer may be gone already
            pass


MAX_PROBE_NBYTES = 4096  # a probe reads a nonce back, not data


class CudaIpcConsumer(ConsumerTransport):
    name = "cuda_ipc"
    kind = transfer_pb2.CUDA_IPC
    payload = "cuda_ipc"
    in_place = True
    shared_mappings = True  # one mapping per pool per process (see _MAPPED)

    @classmethod
    def for_service(cls) -> ConsumerTransport:
        return OfferedCudaIpc()  # no CUDA context in the LM service process

    def __init__(self, device: int | None = None) -> None:
        self.device = device
        self._pools: set[str] = set()

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        if not torch.cuda.is_available():
            raise ProtocolError("no CUDA device in this process")
        ref, nbytes = offer.cuda_probe, offer.cuda_probe_nbytes
        if not 0 < nbytes <= MAX_PROBE_NBYTES:
            raise ProtocolError(f"probe of {nbytes} bytes (1-{MAX_PROBE_NBYTES} allowed)")
        check_range(ref, nbytes)
        buf = mapping(ref, self.device)
        self._pools.add(ref.pool_id)
        check_range(ref, nbytes, buf.numel())
        return seal_proof(buf[ref.offset : ref.offset + nbytes].cpu().numpy().tobytes(), offer.challenge)

    def locate(self, desc: transfer_pb2.TensorDescriptor) -> torch.Tensor:
        if desc.WhichOneof("payload") != "cuda_ipc":
            raise ProtocolError(f"expected a CUDA IPC payload, got {desc.WhichOneof('payload')}")
        check_range(desc.cuda_ipc, desc.nbytes)
        buf = mapping(desc.cuda_ipc, self.device)
        self._pools.add(desc.cuda_ipc.pool_id)
        check_range(desc.cuda_ipc, desc.nbytes, buf.numel())
        return buf

    def receiver(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> Receiver:
        self.locate(desc)
        if dest.numel() != desc.nbytes:
            raise ProtocolError(f"destination has {dest.numel()} bytes, tensor needs {desc.nbytes}")
        copy_out(desc.cuda_ipc, desc.nbytes, dest)
        return Landed()

    def check_source(self, desc: transfer_pb2.TensorDescriptor,
                     proven: transfer_pb2.TransportOffer | None) -> None:
        super().check_source(desc, proven)
        if proven is None or not proven.HasField("cuda_probe"):
            raise ProtocolError("a cuda_ipc item on a stream whose handshake proved no such memory")
        ref, probe = desc.cuda_ipc, proven.cuda_probe
        if (ref.pool_id, ref.handle, ref.pool_nbytes) != (probe.pool_id, probe.handle, probe.pool_nbytes):
            raise ProtocolError(f"item in CUDA pool {ref.pool_id}, but the encoder proved pool {probe.pool_id}")

    def where(self, desc: transfer_pb2.TensorDescriptor) -> tuple[str, int]:
        return desc.cuda_ipc.pool_id, desc.cuda_ipc.offset

    def load(self, desc: transfer_pb2.TensorDescriptor, device: torch.device | str) -> torch.Tensor:
        if desc.WhichOneof("payload") != "cuda_ipc":
            raise ProtocolError(f"expected a CUDA IPC payload, got {desc.WhichOneof('payload')}")
        # One device-to-device copy out of the encoder's CUDA pool, finished
        # before the scheduler half acks (it frees the range).
        raw = torch.empty(desc.nbytes, dtype=torch.uint8, device=device)
        copy_out(desc.cuda_ipc, desc.nbytes, raw)
        return raw

    def forget(self, pool_id: str) -> None:
        self._pools.discard(pool_id)
        forget(pool_id)

    def close(self) -> None:
        for pool_id in list(self._pools):
            self.forget(pool_id)


class OfferedCudaIpc(ConsumerTransport):
    """CUDA IPC as the LM *service* process sees it: usable when offered and
    this host has CUDA and cupy. It never opens the handle (no CUDA context in
    the service process), so the handshake stops before Select; the engine's
    connector proves it for real."""

    name = "cuda_ipc"
    kind = transfer_pb2.CUDA_IPC
    payload = "cuda_ipc"
    provisional = True

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        if not cuda_ipc_usable():
            raise ProtocolError("no CUDA device or no cupy in this process")
        return b""

    def receiver(self, desc, dest):
        raise ProtocolError("the LM service never receives items itself")
