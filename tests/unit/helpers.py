"""Builders shared by the unit tests (the one place for them)."""

from __future__ import annotations

import base64
import io
import logging
import subprocess
import sys

import torch
from PIL import Image

from ectransfer import tensors
from epd.transfer.v1 import transfer_pb2

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width: comparing these is
    bit-exact (NaN payloads, -0.0 and infinities included)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(bits(got), bits(want))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor whose elements are arbitrary bit patterns (NaNs, subnormals, ...)."""
    g = torch.Generator().manual_seed(seed)
    idt = _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(idt)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=idt).view(dtype)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaN, +-inf, +-0.0, the smallest subnormal and a few ordinary numbers."""
    t = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -2.5, 65504.0], dtype=dtype)
    tiny = torch.tensor([1], dtype=_INT_OF_SIZE[t.element_size()]).view(dtype)  # smallest subnormal
    odd_nan = torch.tensor([-1], dtype=_INT_OF_SIZE[t.element_size()]).view(dtype)  # NaN with every payload bit set
    return torch.cat([t, tiny, odd_nan])


def descriptor(t: torch.Tensor) -> transfer_pb2.TensorDescriptor:
    """The header fields the transfer server fills before ``describe``."""
    return transfer_pb2.TensorDescriptor(
        shape=list(t.shape), dtype=tensors.dtype_to_proto(t.dtype), nbytes=tensors.nbytes_of(tuple(t.shape), t.dtype)
    )


def rebuild(dest: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> torch.Tensor:
    return tensors.from_bytes(dest, tuple(desc.shape), tensors.dtype_from_proto(desc.dtype))


def dead_pid() -> int:
    """The pid of a child that has already exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), mode: str = "RGB", noise: bool = False) -> bytes:
    if noise:
        img = Image.frombytes(mode, size, bytes(random_bits((size[0] * size[1] * len(mode),), torch.uint8).tolist()))
    else:
        img = Image.new(mode, size, color=(10, 200, 30) if mode == "RGB" else 128)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load_bench(name: str):
    """``bench/<name>.py`` as a module named ``bench_<name>`` (bench/ is scripts, not a package; its
    own imports, ``bench/common.py``, resolve through bench/ on the path)."""
    import importlib.util
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(bench, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def vllm_serve_app(model: str):
    """vLLM's FastAPI app as `vllm serve --model MODEL` builds it, with the routes of a generative model
    and of a speech-to-text one (vLLM registers the audio routes for those), and no engine: its routes,
    and handlers that need no engine, can be read and called."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = logging.getLogger()
    levels = (root.level, [(h, h.level) for h in root.handlers])
    try:  # vLLM's app sets the root logger to ERROR (SageMaker's standards): put back for later tests
        from vllm.entrypoints.launchers.app import build_app

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model])
        return build_app(args, ("generate", "transcription"), AsyncEngineArgs(model=model).create_model_config())
    finally:
        root.setLevel(levels[0])
        for handler, level in levels[1]:
            handler.setLevel(level)
