"""Producer process for the GPU tests: run with ``--raw N`` it fills a CudaPool
with N seeded random tensors and prints one JSON line per item (descriptor
bytes, hex, and the expected bytes' sha256); with ``--serve`` it runs a
loopback Transfer producer on a CudaPool and prints its endpoint. Either way
it then waits on stdin, so the pool outlives the consumer's copies."""

from __future__ import annotations

import hashlib
import json
import random
import sys

import torch

from epd.transfer.v1 import transfer_pb2

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64]


def random_tensors(n: int, seed: int = 0):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        dtype = rng.choice(DTYPES)
        shape = (rng.randint(0, 512), rng.choice([1, 3, 64, 1024]))
        raw = torch.randint(0, 256, (shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=g)
        yield f"t{i}", raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def main() -> None:
    from ectransfer import tensors

    if sys.argv[1] == "--raw":
        from ectransfer.cuda_ipc import CudaIpcProducer, CudaPool

        pool = CudaPool(256 << 20)
        producer = CudaIpcProducer(pool)
        for ident, t in random_tensors(int(sys.argv[2])):
            data = tensors.as_bytes(t)
            slot = pool.alloc(data.numel())
            pool.view(slot).copy_(data.cuda())
            desc = transfer_pb2.TensorDescriptor(shape=list(t.shape), dtype=tensors.dtype_to_proto(t.dtype),
                                               nbytes=data.numel())
            producer.describe(pool.view(slot), desc)
            print(json.dumps({"id": ident, "desc": desc.SerializeToString().hex(),
                              "sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest()}), flush=True)
        torch.cuda.synchronize()
    else:
        from tests.support.loopback import Producer

        producer = Producer(pool_bytes=256 << 20, transports=("cuda_ipc",))
        for ident, t in random_tensors(int(sys.argv[2])):
            producer.store.put(ident, t.cuda())
        print(json.dumps({"endpoint": producer.endpoint}), flush=True)
    print("READY", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
