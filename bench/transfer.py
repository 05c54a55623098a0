"""Transfer benchmark: encoder output from producer to consumer, per transport.

Drives the real Transfer protocol (grpc.aio on loopback, the same-host control
lane, the shared-memory pool, the client that lands bytes in consumer staging)
through ``tests.support.loopback``, with the producer in its own process (as an
encoder is), and times each item from the consumer's Reserve to the last byte
landing in the consumer's staging (the state change on its transfer thread).
The copy into staging is the one copy an in-place read makes into vLLM's
encoder cache, so shm bandwidth here is what the LM's worker sees. Baselines
measured in the same run on the same tensors:

* ``memcpy``: one ``copy_`` of the same bytes (the floor for any CPU transport);
* ``d2d``: one device-to-device copy (GPU only, the floor for CUDA IPC);
* ``ec_example``: vLLM 0.32's own ECExampleConnector, real class, save on a
  producer instance then load on a consumer instance (safetensors files).

    python bench/transfer.py --quick --json bench/results/transfer-cpu.json --plot bench/results/transfer-cpu.png

With ``--hosts`` (root; network namespaces) the run re-starts itself inside a
"consumer" host and starts a second producer inside a "producer" host, two
network namespaces joined by veth pairs through a bridge
(``tests/multihost/hosts.py``, addresses in 10.77.0.0/24 that route nowhere
else, default MTU 1500), and times gRPC chunks over that link next to the
same transports on loopback in the same run (rows labelled ``grpc (veth)`` and
``grpc (loopback)``). Only gRPC crosses hosts: the hosts have separate
/dev/shm, so shm's probe fails by design.

    python bench/transfer.py --quick --hosts --no-ec-example --transports grpc \
        --json bench/results/transfer-cpu-hosts.json --plot bench/results/transfer-cpu-hosts.png

NIXL (``--transports nixl,...``): on one host UCX picks its own wire (shared memory or CMA);
with ``--hosts`` it crosses the veth link next to gRPC chunks, held to TCP with ``--ucx-tls tcp``
(UCX would otherwise find the shared host). Every row has the CPU seconds per GB moved on
each side (all threads but the benchmark's main one: the transfer threads, gRPC's, UCX's).

    python bench/transfer.py --quick --hosts --no-ec-example --transports nixl,grpc --ucx-tls tcp \
        --json bench/results/transfer-cpu-nixl-hosts.json --plot bench/results/transfer-cpu-nixl-hosts.png

Targets (docs/benchmarks.md): shm >= 80% of memcpy from 4 MiB, gRPC chunks
>= 1 GB/s at 16 MiB, CUDA IPC >= 80% of d2d from 8 MiB, <= 100 us p50 control
overhead on shm/IPC, every transport >= 10x ec_example.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from machine import machine_info, pct

from ectransfer.protocol import TransferState
from peerauth import SecurityConfig
from services.common.spawn import child_env
from tests.support.loopback import Consumer, Producer

# (rows, width) bf16 embeddings: 64 KiB ... 256 MiB
SHAPES_QUICK = [(32, 1024), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
SHAPES_FULL = [(32, 1024), (256, 1024), (512, 1024), (1024, 2048), (1024, 4096), (2048, 4096),
               (4096, 4096), (4096, 8192), (8192, 8192), (16384, 8192)]
CONTROL_SHAPE = (1, 128)  # 256 bytes: the per-item control overhead



def iters_for(nbytes: int, quick: bool) -> int:
    budget = (256 if quick else 2048) << 20
    return max(5 if quick else 10, min(200 if quick else 500, budget // max(nbytes, 1)))


class ProducerPeer:
    """The producer side in its own process (``--producer-peer``), as in
    serving: an encoder's Transfer server never shares a GIL with the LM's
    client. It publishes items the way the encoder connector does -- the slot
    is written first, then adopted into the store on the server's loop thread
    (where the worker's report arrives) -- and answers each ``put`` with the
    ``time.perf_counter()`` of that adoption (CLOCK_MONOTONIC: comparable
    across processes on one host)."""

    def __init__(self, transports: str, pool_bytes: int, chunk_nbytes: int, lane: bool = True,
                 wrap: list[str] = (), bind: str = "127.0.0.1") -> None:
        """``wrap``: an argv prefix that runs the peer elsewhere (``Host.wrap([])``:
        inside another network namespace); ``bind``: the address it serves on."""
        import subprocess

        self.proc = subprocess.Popen(
            [*wrap, sys.executable, os.path.abspath(__file__), "--producer-peer", "--transports", transports,
             "--pool-bytes", str(pool_bytes), "--chunk-nbytes", str(chunk_nbytes), "--peer-bind", bind]
            + ([] if lane else ["--no-lane"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=child_env())
        self.endpoint = self._reply()

    def _reply(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the producer process died")
        return line.strip()

    def put(self, ident: str, shape, dtype: str = "bfloat16", wait: bool = True) -> None:
        """Publishes; with ``wait``, returns once the item is adopted. Without,
        it returns at once and the producer stays silent until ``adopted_at()``
        asks (a reply in flight would wake this process while it lands the item)."""
        self.proc.stdin.write(f"put {ident} {shape[0]} {shape[1]} {dtype} {int(wait)}\n")
        if wait:
            self._reply()

    def adopted_at(self) -> float:
        """``perf_counter`` of the last put's adoption, on the producer."""
        self.proc.stdin.write("stamp\n")
        return float(self._reply())

    def cpu(self) -> float:
        """CPU seconds of the producer's threads but its main one (which publishes items)."""
        self.proc.stdin.write("cpu\n")
        return float(self._reply())

    def wait_released(self, ident: str) -> None:
        self.proc.stdin.write(f"released {ident}\n")
        self._reply()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - best effort
            self.proc.kill()


def serve_producer(args) -> int:
    """``--producer-peer``: a loopback Producer driven over stdin/stdout."""
    import threading

    torch.set_num_threads(1)
    reply = sys.stdout  # the replies; anything else printed (NIXL's log lines) goes to stderr
    sys.stdout = sys.stderr
    transports = tuple(t for t in args.transports.split(",") if t)
    # Plain gRPC on the private bridge too: every host there is this benchmark's own.
    security = None if args.peer_bind.startswith("127.") else SecurityConfig(insecure=True)
    producer = Producer(pool_bytes=args.pool_bytes, chunk_nbytes=args.chunk_nbytes, transports=transports,
                        lane=not args.no_lane, host=args.peer_bind, security=security)
    device = producer.pool.buffer.device
    loop = producer.server._loop
    sources: dict = {}
    last: list = [threading.Event(), [0.0]]  # the last put's (adopted, [perf_counter at adoption])
    print(producer.endpoint, file=reply, flush=True)
    try:
        for line in sys.stdin:
            cmd, *rest = line.split()
            if cmd == "quit":
                break
            if cmd == "cpu":
                print(f"{_cpu_not_main():.9f}", file=reply, flush=True)
                continue
            if cmd == "stamp":
                last[0].wait()  # waited for only now: no wake-up of this thread while the item travels
                print(f"{last[1][0]:.9f}", file=reply, flush=True)
                continue
            if cmd == "released":
                deadline = time.monotonic() + 10
                while producer.store.contains(rest[0]) and time.monotonic() < deadline:
                    time.sleep(0.0002)
                print("ok", file=reply, flush=True)
                continue
            ident, rows, width, dtype, wait = rest[0], int(rest[1]), int(rest[2]), getattr(torch, rest[3]), rest[4] == "1"
            src = sources.get((rows, width, dtype))
            if src is None:
                src = sources[(rows, width, dtype)] = torch.randn(rows, width, device=device).to(dtype)
            data = src.reshape(-1).view(torch.uint8)
            slot = producer.pool.alloc(data.numel(), timeout=30)  # the worker's write into its slot
            producer.pool.view(slot).copy_(data)
            if device.type == "cuda":
                torch.cuda.synchronize()
            done = threading.Event()
            stamp = []

            def adopt(ident=ident, slot=slot, shape=(rows, width), dtype=dtype, stamp=stamp, done=done):
                producer.store.adopt(ident, slot, shape, dtype)  # the report, on the server's loop
                stamp.append(time.perf_counter())
                done.set()

            loop.call_soon_threadsafe(adopt)
            last[:] = [done, stamp]
            if wait:
                done.wait()
                print("ok", file=reply, flush=True)
    finally:
        producer.close()
    return 0


def _cpu_not_main() -> float:
    """CPU seconds of every thread of this process but the calling (main) one."""
    return time.process_time() - time.thread_time()


def time_transport(name: str, shape, iters: int, producer: ProducerPeer, consumer: Consumer,
                   reserve_first: bool = False, cpu: dict | None = None) -> list[float]:
    """Per-item latency through the real protocol, producer in its own process.

    Default: the item is published first, timed from the consumer's fetch (the
    Reserve) to LANDED -- every byte in the consumer's staging, as recorded by
    the consumer's transfer thread (vLLM's scheduler polls that state each
    step; no wake-up of another thread is added). ``reserve_first``: the
    Reserve waits at the producer first (as in serving: the LM asks while the
    encoder runs), timed from the producer adopting the item to LANDED: the
    per-item control overhead. ``cpu``: filled with the CPU seconds per GB moved,
    on each side, over the timed items."""
    nbytes = shape[0] * shape[1] * 2
    lat = []
    for i in range(iters + 2):  # two warm-up items
        if i == 2 and cpu is not None:
            c0, p0 = _cpu_not_main(), producer.cpu()
        ident = f"{name}-{shape[0]}x{shape[1]}-{'push' if reserve_first else 'rtt'}-{i}"
        if reserve_first:
            transfer, _, slot = consumer.start(producer.endpoint, ident, nbytes)
            time.sleep(0.002)  # the Reserve reaches the producer and waits there
            producer.put(ident, shape, wait=False)
        else:
            producer.put(ident, shape)
            t0 = time.perf_counter()
            transfer, _, slot = consumer.start(producer.endpoint, ident, nbytes)
        state = consumer.wait(transfer, timeout=120)
        if reserve_first:
            t0 = producer.adopted_at()
        dt = transfer.changed_at - t0
        consumer.staging.free(slot)
        if state is not TransferState.LANDED:
            raise RuntimeError(f"{name} {shape}: {transfer.error}")
        if i >= 2:
            lat.append(dt)
        producer.wait_released(ident)
    if cpu is not None:
        gb = nbytes * iters / 1e9
        cpu["consumer"] = round((_cpu_not_main() - c0) / gb, 3)
        cpu["producer"] = round((producer.cpu() - p0) / gb, 3)
    return lat


def time_memcpy(shape, iters: int) -> list[float]:
    src = torch.randn(shape).to(torch.bfloat16)
    dst = torch.empty_like(src)
    lat = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        lat.append(time.perf_counter() - t0)
    return lat[2:]


def time_d2d(shape, iters: int) -> list[float]:
    src = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    lat = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t0)
    return lat[2:]


class ECExample:
    """vLLM's ECExampleConnector, real class, producer and consumer instances."""

    def __init__(self, model: str) -> None:
        from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        self.dir = tempfile.mkdtemp(prefix="epd-ecexample-")
        mc = ModelConfig(model=model, dtype="bfloat16")

        def make(role: str):
            cfg = VllmConfig(model_config=mc, ec_transfer_config=ECTransferConfig(
                ec_connector="ECExampleConnector", ec_role=role,
                ec_connector_extra_config={"shared_storage_path": self.dir}))
            return ECExampleConnector(cfg, ECConnectorRole.WORKER)

        self.producer, self.consumer = make("ec_producer"), make("ec_consumer")

    def time(self, shape, iters: int) -> list[float]:
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnectorMetadata, MMMeta

        t = torch.randn(shape).to(torch.bfloat16)
        lat = []
        for i in range(iters + 1):
            h = f"h{shape[0]}x{shape[1]}-{i}"
            t0 = time.perf_counter()
            self.producer.save_caches({h: t}, h)
            meta = ECExampleConnectorMetadata()
            meta.add_mm_data(MMMeta.make_meta(h, shape[0]))
            self.consumer.bind_connector_metadata(meta)
            cache: dict = {}
            self.consumer.start_load_caches(cache)
            lat.append(time.perf_counter() - t0)
            assert torch.equal(cache[h].view(torch.int16), t.view(torch.int16))
            os.remove(os.path.join(self.dir, h, "encoder_cache.safetensors"))
        return lat[1:]


def machine() -> dict:
    info = {**machine_info(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (< 2 minutes on CPU)")
    ap.add_argument("--json", help="write rows here")
    ap.add_argument("--plot", help="write a PNG plot here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the baseline is one device-to-device copy and the transports default to "
                         "cuda_ipc,shm,grpc (CUDA IPC lands in a GPU tensor; shm and grpc in host staging)")
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for NIXL on both sides (e.g. tcp: hold UCX to TCP)")
    ap.add_argument("--transports", default="", help="comma-separated (cuda_ipc, shm, grpc, nixl); default shm,grpc "
                                                     "(cuda_ipc,shm,grpc with --device cuda)")
    ap.add_argument("--model", default="", help="model dir for the ECExampleConnector baseline (default: tiny)")
    ap.add_argument("--no-ec-example", action="store_true", help="skip vLLM's ECExampleConnector baseline")
    ap.add_argument("--no-lane", action="store_true",
                    help="keep item messages on the gRPC stream (no same-host control lane), for comparison")
    ap.add_argument("--hosts", action="store_true",
                    help="also time grpc from a producer in another network namespace, over a veth link "
                         "through a bridge (needs root); the other transports stay on loopback")
    ap.add_argument("--producer-peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pool-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-nbytes", type=int, default=4 << 20, help=argparse.SUPPRESS)
    # Set by --hosts for its re-run inside the consumer host: the producer host's argv prefix and address.
    ap.add_argument("--peer-wrap", default="", help=argparse.SUPPRESS)
    ap.add_argument("--peer-bind", default="127.0.0.1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ucx_tls:  # before any NIXL agent: UCX reads it then (the producer peers inherit it)
        os.environ["UCX_TLS"] = args.ucx_tls
    if args.producer_peer:
        return serve_producer(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    names = [t for t in (args.transports or ("cuda_ipc,shm,grpc" if args.device == "cuda" else "shm,grpc"))
             .split(",") if t]
    if args.hosts:
        if "grpc" not in names:
            ap.error("--hosts times grpc (and nixl) across hosts: include grpc in --transports")
        return run_in_hosts()
    # One thread per copy on both sides, so the baseline is one memcpy and the
    # numbers do not depend on OpenMP threads waking up.
    torch.set_num_threads(1)

    shapes = SHAPES_QUICK if args.quick else SHAPES_FULL
    max_bytes = max(r * w for r, w in shapes) * 2
    pool_bytes = 2 * max_bytes + (16 << 20)
    # (transport, link): every transport on loopback; grpc once more across hosts under --hosts.
    runs = [(name, "loopback") for name in names]
    if args.peer_wrap:
        runs += [(name, "veth") for name in ("grpc", "nixl") if name in names]
    ec = None
    if not args.no_ec_example:
        try:
            import vllm  # noqa: F401
        except ImportError as e:  # a GPU host with torch but no vLLM: the other rows still mean something
            print(f"ec_example baseline skipped: vLLM is not importable ({e})", file=sys.stderr)
        else:
            from services.cli import default_model

            ec = ECExample(args.model or default_model())
    rows = []
    cuda = args.device == "cuda"
    # The floor for each transport: CUDA IPC lands in GPU memory (one device-to-device copy), shm and
    # gRPC in host staging (one memcpy); --device cuda measures both.
    floors = ["memcpy"] + (["d2d"] if cuda else [])
    # One producer process per link for the host transports, one for CUDA IPC (its pool is on the GPU).
    peers: dict[tuple[str, str], ProducerPeer] = {}
    lanes: list[tuple[str, str, str, ProducerPeer, Consumer]] = []  # (label, transport, link, producer, consumer)
    host = ",".join(n for n in names if n != "cuda_ipc")
    try:
        base = {}
        for shape in shapes:
            nbytes = shape[0] * shape[1] * 2
            iters = iters_for(nbytes, args.quick)
            for floor in floors:
                lat = time_d2d(shape, iters) if floor == "d2d" else time_memcpy(shape, iters)
                base[floor, shape] = nbytes / statistics.median(lat) / 1e9
                rows.append(_row(floor, nbytes, shape, lat, None, None))
            if ec is not None:
                ec_lat = ec.time(shape, max(3, iters // 4))
                rows.append(_row("ec_example", nbytes, shape, ec_lat, "memcpy", base["memcpy", shape]))
        for name, link in runs:
            key = ("cuda_ipc" if name == "cuda_ipc" else host if link == "loopback" else name, link)
            if key not in peers:
                cross = link != "loopback"
                peers[key] = ProducerPeer(key[0], pool_bytes, 4 << 20, lane=not args.no_lane,
                                          wrap=json.loads(args.peer_wrap) if cross else (),
                                          bind=args.peer_bind if cross else "127.0.0.1")
            consumer = Consumer(transports=(name,), staging_bytes=max_bytes + (16 << 20), timeout_s=120,
                                device="cuda" if name == "cuda_ipc" else "cpu")
            label = f"{name} ({link})" if args.peer_wrap else name
            lanes.append((label, name, link, peers[key], consumer))
        n_ctl = 200 if args.quick else 1000
        ctl_bytes = CONTROL_SHAPE[0] * CONTROL_SHAPE[1] * 2
        for label, name, link, producer, consumer in lanes:
            rows.append(_row(label, ctl_bytes, CONTROL_SHAPE,
                             time_transport(name, CONTROL_SHAPE, n_ctl, producer, consumer), None, None,
                             kind="control_rtt", link=link))
            rows.append(_row(label, ctl_bytes, CONTROL_SHAPE,
                             time_transport(name, CONTROL_SHAPE, n_ctl // 2, producer, consumer, reserve_first=True),
                             None, None, kind="control_push", link=link))
        # Sizes outer, transports inner: a slow patch of a shared machine hits every transport alike.
        for shape in shapes:
            nbytes = shape[0] * shape[1] * 2
            for label, name, link, producer, consumer in lanes:
                cpu: dict = {}
                lat = time_transport(name, shape, iters_for(nbytes, args.quick), producer, consumer, cpu=cpu)
                floor = "d2d" if name == "cuda_ipc" else "memcpy"
                rows.append(_row(label, nbytes, shape, lat, floor, base[floor, shape], link=link,
                                 cpu_s_per_gb=cpu))
    finally:
        for lane in lanes:
            lane[4].close()
        for peer in peers.values():
            peer.close()
    order = {name: i for i, name in enumerate(dict.fromkeys(r["transport"] for r in rows))}
    rows.sort(key=lambda r: order[r["transport"]])  # stable: sizes stay in order within a transport
    ec_by_size = {r["nbytes"]: r["gbps"] for r in rows if r["transport"] == "ec_example"}
    for r in rows:
        if r["transport"] not in ("memcpy", "d2d", "ec_example") and r["kind"] == "bandwidth":
            r["ec_example_gbps"] = ec_by_size.get(r["nbytes"])
            r["vs_ec_example"] = round(r["gbps"] / r["ec_example_gbps"], 1) if r["ec_example_gbps"] else None
    _print(rows)
    result = {"machine": machine(), "device": args.device, "quick": args.quick, "lane": not args.no_lane,
              "ucx_tls": os.environ.get("UCX_TLS", ""),
              "method": "producer in its own process; latency = consumer fetch (or producer adoption, "
                        "control_push) -> LANDED recorded on the consumer's transfer thread", "rows": rows}
    if args.peer_wrap:
        result["hosts"] = {"link": "two network namespaces, each with a veth pair into one bridge; plain gRPC "
                                   "(no TLS); loopback rows in the consumer's namespace",
                           "producer": args.peer_bind, "mtu": _mtu("eth0")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        _plot(rows, args.plot, result["machine"])
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_in_hosts() -> int:
    """``--hosts``: makes two hosts (``tests/multihost/hosts.py``), re-runs this
    command inside "consumer" (its network; it keeps the root's /dev/shm, so the
    producer host's own /dev/shm stays reachable for its bind) with the
    "producer" host's argv prefix and address, and deletes both namespaces
    whatever happens (SIGTERM included;
    after a SIGKILL the next run's ``sweep_stale`` does it)."""
    import signal
    import subprocess

    from tests.multihost.hosts import Network, Unavailable, check_available, sweep_stale

    try:
        check_available()
    except Unavailable as e:
        print(f"--hosts needs network namespaces: {e}", file=sys.stderr)
        return 2
    sweep_stale()
    net = Network()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        net.start()
        consumer, producer = net.add_host("consumer"), net.add_host("producer")
        argv = [sys.executable, os.path.abspath(__file__), *(a for a in sys.argv[1:] if a != "--hosts"),
                "--peer-wrap", json.dumps(producer.wrap([])), "--peer-bind", producer.ip]
        return subprocess.run(consumer.wrap_net(argv), cwd=os.getcwd(), check=False, env=child_env()).returncode
    finally:
        net.close()
        signal.signal(signal.SIGTERM, previous)


def _mtu(dev: str) -> int | None:
    try:
        with open(f"/sys/class/net/{dev}/mtu") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _row(transport, nbytes, shape, lat, baseline, baseline_gbps, kind="bandwidth", link=None,
         cpu_s_per_gb=None) -> dict:
    p50 = statistics.median(lat)
    gbps = nbytes / p50 / 1e9
    return {"transport": transport, "link": link, "kind": kind, "nbytes": nbytes, "shape": list(shape), "iters": len(lat),
            "cpu_s_per_gb": cpu_s_per_gb or None,
            "gbps": round(gbps, 3), "p50_us": round(p50 * 1e6, 1), "p99_us": round(pct(lat, 0.99) * 1e6, 1),
            "baseline": baseline, "baseline_gbps": round(baseline_gbps, 3) if baseline_gbps else None,
            "vs_baseline": round(gbps / baseline_gbps, 3) if baseline_gbps else None}


def _print(rows: list[dict]) -> None:
    hdr = (f"{'transport':<16}{'size':>10}{'GB/s':>9}{'p50 us':>11}{'p99 us':>11}{'vs base':>9}{'vs ECEx':>9}"
           f"{'cpu s/GB p,c':>14}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        size = f"{r['nbytes'] / 1024:.0f}K" if r["nbytes"] < 1 << 20 else f"{r['nbytes'] >> 20}M"
        if r["kind"] == "control_rtt":
            size += "*"
        elif r["kind"] == "control_push":
            size += "**"
        vb = f"{r['vs_baseline']:.0%}" if r.get("vs_baseline") else ""
        ve = f"{r['vs_ec_example']:.0f}x" if r.get("vs_ec_example") else ""
        cpu = f"{r['cpu_s_per_gb']['producer']:.2f},{r['cpu_s_per_gb']['consumer']:.2f}" if r.get("cpu_s_per_gb") else ""
        print(f"{r['transport']:<16}{size:>10}{r['gbps']:>9.2f}{r['p50_us']:>11.1f}{r['p99_us']:>11.1f}{vb:>9}{ve:>9}"
              f"{cpu:>14}")
    print("*  256-byte item, item ready before the Reserve: a full Reserve -> header round trip")
    print("** 256-byte item, Reserve outstanding (as in serving): item adopted by the producer -> landed "
          "= per-item control overhead")


def _plot(rows: list[dict], path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["transport"] for r in rows):
        pts = sorted((r["nbytes"], r["gbps"]) for r in rows if r["transport"] == name and r["kind"] == "bandwidth")
        style = "--" if name in ("memcpy", "d2d", "ec_example") else "-o"
        ax.plot([p[0] / (1 << 20) for p in pts], [p[1] for p in pts], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (MiB, bf16 embeddings)")
    ax.set_ylabel("GB/s (p50, producer -> consumer)")
    ax.set_title(f"epd-serve transfer: {info.get('gpu') or info['cpu']} ({info['cores']} cores)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
