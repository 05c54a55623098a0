"""Issue 3 GPU must-show: two processes on one GPU, 100 random tensors of random
shapes and dtypes, bit-identical after transfer; each pool mapped once.
Skipped cleanly without CUDA and cupy (tests/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(mode: str, n: int):
    proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.ipc_producer", mode, str(n)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    while (line := proc.stdout.readline()) and line.strip() != "READY":
        lines.append(json.loads(line))
    assert line, "producer process failed"
    return proc, lines


def test_two_processes_one_gpu_100_random_tensors_bit_identical_pool_mapped_once():
    import torch

    from ectransfer.cuda_ipc import CudaIpcConsumer
    from epd.common.v1 import common_pb2

    proc, items = _start("--raw", 100)
    consumer = CudaIpcConsumer()
    try:
        for item in items:
            desc = common_pb2.TensorDescriptor.FromString(bytes.fromhex(item["desc"]))
            dest = torch.empty(desc.nbytes, dtype=torch.uint8, device="cuda")
            assert consumer.receiver(desc, dest).complete
            assert hashlib.sha256(dest.cpu().numpy().tobytes()).hexdigest() == item["sha256"], item["id"]
        assert consumer.open_count == 1
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_cuda_ipc_through_the_transfer_protocol_is_chosen_and_exact():
    import torch

    from ectransfer import tensors
    from ectransfer.loopback import Consumer
    from ectransfer.protocol import TransferState
    from tests.gpu.ipc_producer import random_tensors

    proc, lines = _start("--serve", 20)
    consumer = Consumer(transports=("cuda_ipc",), staging_bytes=256 << 20, device="cuda")
    try:
        for ident, t in random_tensors(20):
            nbytes = t.numel() * t.element_size()
            transfer, fetch, slot = consumer.start(lines[0]["endpoint"], ident, nbytes)
            assert consumer.wait(transfer) is TransferState.LANDED, transfer.error
            got = consumer.staging.view(slot).cpu()
            assert torch.equal(got, tensors.as_bytes(t)), ident
            consumer.staging.free(slot)
        (t,) = [c for c in consumer.client.transports]
        assert t.open_count == 1
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)
