"""Transport registry. Registration is central and lazy so that only the chosen
backend is imported (importing ``ectransfer`` never imports CUDA libraries).

The only module besides the transports' own that knows transports by name:
callers hold transport objects and ask them (``ectransfer.base``)."""

from __future__ import annotations

import importlib
import logging

from epd.transfer.v1 import transfer_pb2

# name -> (module, producer class, consumer class, proto enum)
_REGISTRY: dict[str, tuple[str, str, str, int]] = {
    "cuda_ipc": ("ectransfer.cuda_ipc", "CudaIpcProducer", "CudaIpcConsumer", transfer_pb2.CUDA_IPC),
    "shm": ("ectransfer.shm", "ShmProducer", "ShmConsumer", transfer_pb2.SHM),
    "grpc": ("ectransfer.grpc_stream", "GrpcChunkProducer", "GrpcChunkConsumer", transfer_pb2.GRPC_CHUNKS),
    # Opt-in (never in ``auto``): UCX's wire between hosts is the cluster's to set (docs/configuration.md).
    "nixl": ("ectransfer.nixl", "NixlProducer", "NixlConsumer", transfer_pb2.NIXL),
}
NAMES = tuple(_REGISTRY)
AUTO = "auto"

logger = logging.getLogger(__name__)


def cuda_ipc_usable() -> bool:
    """This process can take part in CUDA IPC: a CUDA device and cupy."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy  # noqa: F401  (importable is the test)
    except Exception:  # noqa: BLE001 - no CUDA build, no cupy, no driver
        return False
    return True


def resolve(names: list[str], role: str) -> list[str]:
    """Expands ``auto`` (the default) into the transports this process can use,
    best first. Producer: ``cuda_ipc,grpc`` where CUDA IPC works (the outbound
    pool then lives on the GPU, which shm cannot describe), else ``shm,grpc``.
    Consumer: ``cuda_ipc,shm,grpc`` where CUDA IPC works, else ``shm,grpc``.
    Explicit names are kept as given (a single one forces it)."""
    if role not in ("producer", "consumer"):
        raise ValueError(f"role must be producer or consumer, got {role!r}")
    out: list[str] = []
    for name in names:
        if name == AUTO:
            cuda = cuda_ipc_usable()
            auto = (["cuda_ipc"] if cuda else []) + (["shm"] if role == "consumer" or not cuda else []) + ["grpc"]
            out += [n for n in auto if n not in out]
        elif name not in out:
            out.append(name)
    return out


def transport_enum(name: str) -> int:
    if name == AUTO:
        raise ValueError("'auto' names no single transport; resolve() it first")
    try:
        return _REGISTRY[name][3]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; allowed: {', '.join(NAMES)}") from None


def transport_name(value: int) -> str:
    for name, entry in _REGISTRY.items():
        if entry[3] == value:
            return name
    raise ValueError(f"unknown transport enum {value}")


def _load(name: str, index: int):
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; allowed: {', '.join(NAMES)}")
    module = importlib.import_module(_REGISTRY[name][0])
    return getattr(module, _REGISTRY[name][index])


def make_producer(name: str, **kwargs):
    return _load(name, 1)(**kwargs)


def make_consumer(name: str, **kwargs):
    return _load(name, 2)(**kwargs)


def make_service_consumer(name: str):
    """The consumer transport as the LM service process checks encoders with
    (``ConsumerTransport.for_service``)."""
    return _load(name, 2).for_service()


def make_producers(names: list[str], pool_bytes: int, chunk_nbytes: int, role: str = "outbound"):
    """The outbound pool and the producer transports that serve it, for the
    resolved ``names`` (best first). The transport with the highest
    ``pool_priority`` makes the pool (CUDA IPC: on the GPU; else a shared-memory
    segment); transports that cannot describe it are not offered (a warning
    says so). Returns (pool, {kind: transport}, names offered); the caller owns
    the pool and closes it after the transports."""
    from ectransfer.base import ProducerTransport

    classes = {name: _load(name, 1) for name in names}
    lead = max(classes.values(), key=lambda c: c.pool_priority, default=ProducerTransport)
    pool = lead.make_pool(pool_bytes, role)
    if pool is None:  # the default: a shared-memory segment, which vLLM's worker (maybe another process)
        from ectransfer.shm import ShmPool  # writes into and every transport can serve from

        pool = ShmPool(pool_bytes, role=role)
    offered = [name for name in names if classes[name].describes(pool)]
    if len(offered) < len(names):
        logger.warning("transports %s: %s not offered: they cannot describe the outbound pool %s makes (%s); "
                       "LMs that would use them fall back", names, ",".join(n for n in names if n not in offered),
                       lead.name, type(pool).__name__)
    transports = {}
    for name in offered:
        t = classes[name].build(pool, chunk_nbytes)
        transports[t.kind] = t
    return pool, transports, offered


def close_producers(pool, transports: dict) -> None:
    """Closes what ``make_producers`` made, once its server has stopped: each transport (a NIXL producer's
    progress thread and its registration), then the pool. A transport that fails to close is logged and
    the rest are still closed."""
    for t in transports.values():
        try:
            t.close()
        except Exception:  # closing: the others and the pool still go
            logger.exception("closing the %s producer transport failed", t.name)
    pool.close()
