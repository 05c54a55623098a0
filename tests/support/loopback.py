"""A real Transfer server and client in one process, without vLLM.

``Producer`` is the encoder side (shared-memory outbound pool, OutboundStore,
TransferService on a loopback port); ``Consumer`` is the LM side (a staging
pool and a TransferClient). The integration tests, the namespace probe and
``bench/transfer.py`` drive the real protocol through them (a test harness:
it lives with the tests, not in the product package). Buffers: the
producer's items belong to its store until acked; ``Consumer.get`` frees its
staging slot before returning (it hands back a copy)."""

from __future__ import annotations

import torch

from ectransfer import factory, tensors
from ectransfer.client import TransferClient
from ectransfer.outbound import OutboundStore
from ectransfer.pool import Pool
from ectransfer.protocol import ItemTransfer, TransferState, make_compat
from ectransfer.server import TransferServerThread, TransferServicer


def compat(width: int = 128, model: str = "test-model"):
    return make_compat(vllm_version="0.32.0", model=model, dtype="bfloat16", embed_width=width)


class Producer:
    def __init__(self, pool_bytes: int = 64 << 20, item_wait_s: float = 10.0, ttl_s: float = 60.0,
                 transports=("shm", "grpc"), chunk_nbytes: int = 1 << 20, compat_info=None,
                 host: str = "127.0.0.1", lane: bool = True, security=None, limits=None,
                 max_settled_claims: int = 16384) -> None:
        # As the encoder's connector does: CUDA IPC puts the pool on the GPU, else it is shared memory.
        self.pool, ts, _ = factory.make_producers(list(transports), pool_bytes, chunk_nbytes, role="test")
        self.transports = ts
        self.store = OutboundStore(self.pool, ttl_s=ttl_s, max_settled_claims=max_settled_claims)
        self.servicer = TransferServicer(self.store, compat_info or compat(), "producer-1", ts, item_wait_s=item_wait_s,
                                         lane=lane, limits=limits)
        self.server = TransferServerThread(self.servicer, host, 0, sweep_s=0.05, security=security)
        self.endpoint = f"{host}:{self.server.start()}"

    def close(self) -> None:
        self.server.stop()
        factory.close_producers(self.pool, self.transports)


class Consumer:
    def __init__(self, transports=("shm", "grpc"), compat_info=None, timeout_s: float = 10.0,
                 staging_bytes: int = 64 << 20, device: str = "cpu", security=None) -> None:
        self.staging = Pool(staging_bytes, device=device)
        self.client = TransferClient(compat_info or compat(), "consumer-1",
                                     [factory.make_consumer(n) for n in transports], timeout_s=timeout_s,
                                     security=security).start()

    def start(self, endpoint: str, ident: str, nbytes: int, claim: str = ""):
        slot = self.staging.alloc(nbytes)
        transfer = ItemTransfer(ident, nbytes)
        fetch = self.client.fetch(transfer, endpoint, self.staging.view(slot), request_id="r", claim=claim)
        return transfer, fetch, slot

    def wait(self, transfer: ItemTransfer, timeout: float = 20.0) -> TransferState:
        transfer.wait_for({TransferState.LANDED, TransferState.FAILED}, timeout)
        return transfer.state

    def get(self, endpoint: str, ident: str, nbytes: int, claim: str = "") -> tuple[ItemTransfer, torch.Tensor | None]:
        transfer, fetch, slot = self.start(endpoint, ident, nbytes, claim)
        state = self.wait(transfer)
        out = None
        if state is TransferState.LANDED:
            out = tensors.from_bytes(self.staging.view(slot).clone(), fetch.shape, fetch.dtype)
        self.staging.free(slot)
        return transfer, out

    def close(self) -> None:
        self.client.close()
