"""Transport registry. Registration is central and lazy so that only the chosen
backend is imported (importing ``ectransfer`` never imports CUDA libraries)."""

from __future__ import annotations

import importlib

from epd.common.v1 import common_pb2

# name -> (module, producer class, consumer class, proto enum)
_REGISTRY: dict[str, tuple[str, str, str, int]] = {
    "cuda_ipc": ("ectransfer.cuda_ipc", "CudaIpcProducer", "CudaIpcConsumer", common_pb2.CUDA_IPC),
    "shm": ("ectransfer.shm", "ShmProducer", "ShmConsumer", common_pb2.SHM),
    "grpc": ("ectransfer.grpc_stream", "GrpcChunkProducer", "GrpcChunkConsumer", common_pb2.GRPC_CHUNKS),
}
NAMES = tuple(_REGISTRY)


def transport_enum(name: str) -> int:
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
