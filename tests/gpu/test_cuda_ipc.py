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

from epd.transfer.v1 import transfer_pb2

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

    from ectransfer import cuda_ipc
    from ectransfer.cuda_ipc import CudaIpcConsumer

    proc, items = _start("--raw", 100)
    consumer = CudaIpcConsumer()
    opened = cuda_ipc.open_count()
    try:
        for item in items:
            desc = transfer_pb2.TensorDescriptor.FromString(bytes.fromhex(item["desc"]))
            dest = torch.empty(desc.nbytes, dtype=torch.uint8, device="cuda")
            assert consumer.receiver(desc, dest).complete
            assert hashlib.sha256(dest.cpu().numpy().tobytes()).hexdigest() == item["sha256"], item["id"]
        assert cuda_ipc.open_count() - opened == 1
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_cuda_ipc_through_the_transfer_protocol_is_chosen_and_exact():
    import torch

    from ectransfer import cuda_ipc, tensors
    from ectransfer.protocol import TransferState
    from tests.gpu.ipc_producer import random_tensors
    from tests.support.loopback import Consumer

    proc, lines = _start("--serve", 20)
    consumer = Consumer(transports=("cuda_ipc",), staging_bytes=256 << 20, device="cuda")
    opened = cuda_ipc.open_count()
    try:
        for ident, t in random_tensors(20):
            nbytes = t.numel() * t.element_size()
            transfer, fetch, slot = consumer.start(lines[0]["endpoint"], ident, nbytes)
            assert consumer.wait(transfer) is TransferState.LANDED, transfer.error
            got = consumer.staging.view(slot).cpu()
            assert torch.equal(got, tensors.as_bytes(t)), ident
            consumer.staging.free(slot)
        assert cuda_ipc.open_count() - opened == 1  # probe and 20 items: one open
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_cuda_ipc_into_host_staging_is_exact():
    """The other copy path (``_copy_and_wait``'s torch fallback): an LM whose
    staging is host memory, as when an in-place item is demoted to staging,
    gets the same bytes through a device-to-host copy."""
    import torch

    from ectransfer import tensors
    from ectransfer.protocol import TransferState
    from tests.gpu.ipc_producer import random_tensors
    from tests.support.loopback import Consumer

    proc, lines = _start("--serve", 10)
    consumer = Consumer(transports=("cuda_ipc",), staging_bytes=64 << 20, device="cpu")
    try:
        for ident, t in random_tensors(10):
            nbytes = t.numel() * t.element_size()
            transfer, fetch, slot = consumer.start(lines[0]["endpoint"], ident, nbytes)
            assert consumer.wait(transfer) is TransferState.LANDED, transfer.error
            assert not consumer.staging.view(slot).is_cuda
            assert torch.equal(consumer.staging.view(slot).clone(), tensors.as_bytes(t)), ident
            consumer.staging.free(slot)
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_in_place_read_from_another_process_is_one_device_copy_and_exact():
    """What the LM's worker does with an in-place CUDA IPC item: locate (the
    client), then ``copy_out`` straight into a tensor on its device, then ack."""
    import torch

    from ectransfer import cuda_ipc, tensors
    from ectransfer.protocol import ItemTransfer, TransferState
    from tests.gpu.ipc_producer import random_tensors
    from tests.support.loopback import Consumer

    proc, lines = _start("--serve", 10)
    consumer = Consumer(transports=("cuda_ipc",), staging_bytes=256 << 20, device="cuda")
    try:
        for ident, t in random_tensors(10):
            nbytes = t.numel() * t.element_size()
            transfer = ItemTransfer(ident, nbytes)
            slot = consumer.staging.alloc(nbytes)  # sizes the Reserve; not written when read in place
            consumer.staging.view(slot).fill_(0xA5)
            fetch = consumer.client.fetch(transfer, lines[0]["endpoint"], consumer.staging.view(slot), "r",
                                          in_place=True)
            assert consumer.wait(transfer) is TransferState.LANDED, transfer.error
            assert fetch.source is not None and fetch.source.WhichOneof("payload") == "cuda_ipc"
            dest = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            cuda_ipc.copy_out(fetch.source.cuda_ipc, nbytes, dest)
            consumer.client.ack(lines[0]["endpoint"], ident)
            assert bool(consumer.staging.view(slot).eq(0xA5).all()), "nothing went through staging"
            consumer.staging.free(slot)
            assert torch.equal(dest.cpu(), tensors.as_bytes(t)), ident
    finally:
        consumer.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_connector_halves_with_cuda_ipc_save_serve_and_load_exactly():
    """Both connector halves wired to CUDA IPC (needs vLLM as well as CUDA):
    the encoder's worker writes into the exported pool, the LM's worker copies
    device to device into its encoder cache, the ack frees the pool."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch

    from ectransfer.connector.config import ConnectorConfig
    from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
    from ectransfer.connector.producer import ProducerScheduler, ProducerWorker
    from tests.integration.connector_fakes import embedding, request, steps_until, vllm_config

    cfg = ConnectorConfig(outbound_pool_bytes=1 << 20, transports=["cuda_ipc", "grpc"], model_name="test-model")
    ps, pw = ProducerScheduler(vllm_config("enc-1"), cfg).start(), ProducerWorker(vllm_config("enc-1"), cfg).start()
    sched = ConsumerScheduler(vllm_config("lm-1"), ConnectorConfig(transports=["cuda_ipc"], model_name="test-model")).start()
    worker = ConsumerWorker(vllm_config("lm-1"), sched.cfg)
    try:
        r = request("e1", [("c1", 16)])
        assert ps.ensure_cache_available(r, 0)
        meta = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={"e1": [0]}, total_num_scheduled_tokens=0))
        assert meta.saves[0].cuda_ref
        out = {"c1": embedding(16, 31).cuda()}
        pw.begin_step(out, meta)
        pw.save(out, "c1")
        assert steps_until(lambda: ps.store.contains("c1"))
        req = request("l1", [("c1", 16)], f"127.0.0.1:{ps.server.bound_port}", claim="e1")  # e1's Encode claim
        assert steps_until(lambda: sched.ensure_cache_available(req, 0))
        sched.update_state_after_alloc(req, 0)
        load = sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0))
        assert load.loads[0].transport == "cuda_ipc" and load.loads[0].source  # read in place
        cache: dict = {}
        worker.load(cache, load)
        sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=worker.build_worker_meta()))
        assert cache["c1"].is_cuda and torch.equal(cache["c1"].view(torch.int16), out["c1"].view(torch.int16))
        steps_until(lambda: not ps.store.contains("c1"), 5)
        assert not ps.store.contains("c1")  # acked after the load
    finally:
        worker.shutdown()
        sched.shutdown()
        pw.shutdown()
        ps.shutdown()


def test_a_pool_is_mapped_at_its_real_size_and_an_inflated_claim_is_refused():
    """A producer's ref claims the pool's size; the consumer maps the allocation the
    handle really opens (the driver's cuMemGetAddressRange), so a ref claiming more
    is refused before any copy, and the honest ref maps at the real size."""
    import torch

    from ectransfer import cuda_ipc
    from ectransfer.protocol import ProtocolError

    proc, items = _start("--raw", 1)
    try:
        desc = transfer_pb2.TensorDescriptor.FromString(bytes.fromhex(items[0]["desc"]))
        honest = desc.cuda_ipc
        inflated = transfer_pb2.CudaIpcRef()
        inflated.CopyFrom(honest)
        inflated.pool_nbytes = honest.pool_nbytes * 4
        with pytest.raises(ProtocolError, match="claims"):
            cuda_ipc.mapping(inflated)
        buf = cuda_ipc.mapping(honest)
        assert buf.numel() >= honest.pool_nbytes
        base, size = cuda_ipc.allocation_nbytes(buf.data_ptr())
        assert (base, size) == (buf.data_ptr(), buf.numel())
        with pytest.raises(ProtocolError):  # the pool is known now: the same id with another size
            cuda_ipc.mapping(inflated)
        dest = torch.empty(desc.nbytes, dtype=torch.uint8, device="cuda")
        cuda_ipc.copy_out(honest, desc.nbytes, dest)
        cuda_ipc.forget(honest.pool_id)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
