"""Tensor <-> bytes helpers shared by every transport.

A transport moves raw bytes; these helpers turn a tensor into a byte view
(without copying when the tensor is contiguous and on the CPU) and rebuild a
tensor from bytes plus (shape, dtype). Bit-exactness is the contract: no dtype
conversion ever happens here.
"""

from __future__ import annotations

import math

import torch

from epd.transfer.v1 import transfer_pb2

_DTYPES: dict[torch.dtype, int] = {
    torch.bfloat16: transfer_pb2.BFLOAT16,
    torch.float16: transfer_pb2.FLOAT16,
    torch.float32: transfer_pb2.FLOAT32,
    torch.float64: transfer_pb2.FLOAT64,
    torch.int8: transfer_pb2.INT8,
    torch.uint8: transfer_pb2.UINT8,
    torch.int32: transfer_pb2.INT32,
    torch.int64: transfer_pb2.INT64,
}
_FROM_PROTO = {v: k for k, v in _DTYPES.items()}
_NAMES = {str(k).removeprefix("torch."): k for k in _DTYPES}


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; allowed: {sorted(_NAMES)}") from None


def dtype_from_proto(value: int) -> torch.dtype:
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown DType enum value {value}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _NAMES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; allowed: {sorted(_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes_of(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize  # no tensor allocation: it is on the per-item control path


def as_bytes(t: torch.Tensor, keep_device: bool = False) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes, on the CPU unless ``keep_device``
    (copies only if ``t`` is non-contiguous or must move). The result shares
    memory with ``t`` when no copy was needed, so the caller keeps ``t`` alive."""
    if t.device.type != "cpu" and not keep_device:
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def from_bytes(buf: torch.Tensor, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets a flat uint8 tensor as ``shape``/``dtype`` (no copy)."""
    expected = nbytes_of(shape, dtype)
    if buf.numel() != expected:
        raise ValueError(f"buffer has {buf.numel()} bytes, shape {list(shape)} {dtype} needs {expected}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return buf.view(dtype).reshape(tuple(shape))
