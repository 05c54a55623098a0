"""Helpers both halves of the connector share."""

from __future__ import annotations

import torch
import vllm
from vllm.platforms import current_platform

from ectransfer.protocol import make_compat
from epd.transfer.v1 import transfer_pb2


def compat_for(vllm_config, model_name: str) -> transfer_pb2.CompatInfo:
    mc = vllm_config.model_config
    return make_compat(
        vllm_version=vllm.__version__,
        model=model_name or mc.model,
        dtype=str(mc.dtype).removeprefix("torch."),
        embed_width=mc.get_hidden_size(),
    )


def worker_device() -> torch.device:
    if current_platform.is_cuda_alike():
        return torch.device(f"cuda:{current_platform.current_device()}")
    return torch.device(current_platform.device_type)
