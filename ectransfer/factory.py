"""Transport registry. Registration is central and lazy so that only the chosen
backend is imported (importing ``ectransfer`` never imports CUDA libraries)."""

from __future__ import annotations

import importlib

from epd.transfer.v1 import transfer_pb2

# name -> (module, producer class, consumer class, proto enum)
_REGISTRY: dict[str, tuple[str, str, str, int]] = {
    "cuda_ipc": ("ectransfer.cuda_ipc", "CudaIpcProducer", "CudaIpcConsumer", transfer_pb2.CUDA_IPC),
    "shm": ("ectransfer.shm", "ShmProducer", "ShmConsumer", transfer_pb2.SHM),
    "grpc": ("ectransfer.grpc_stream", "GrpcChunkProducer", "GrpcChunkConsumer", transfer_pb2.GRPC_CHUNKS),
}
NAMES = tuple(_REGISTRY)
AUTO = "auto"


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
