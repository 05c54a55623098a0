"""Gateway overhead benchmark: what the gateway adds over calling the LM directly.

Text-only chat requests, closed loop at several concurrencies, all in one run.
Per request, latency is send -> last message (gRPC: the stream has ended;
REST: the last byte of the body). Paths, each measured at every concurrency:

* ``direct``: grpc.aio client -> ``epd.lm.v1.LMService/Generate`` with the chat body (the
  baseline of ``rest``: the LM answers in one message);
* ``direct-stream``: the same with ``stream: true`` (the baseline of ``rest-stream`` and ``grpc``:
  one server-sent event per LM message);
* ``rest``: aiohttp client (keep-alive pool) -> gateway ``POST /v1/chat/completions``;
* ``rest-stream``: the same with ``stream: true``, timed to the last byte (``[DONE]``);
* ``grpc``: grpc.aio client -> gateway ``epd.gateway.v1.GatewayService/ChatCompletion`` with the
  streaming body (one chunk per message), timed to the end of the stream.

Every body is the same OpenAI chat request (the streaming ones with
``stream_options.include_usage``, whose usage chunk says how many tokens came).

``added`` = path - its baseline, same concurrency, same run. Paths are interleaved:
each concurrency runs ``--rounds`` rounds, each round every path (in a rotated
order) for its share of the requests, so drift hits all paths alike.

Answers are ``--max-tokens`` long (default 1 and 16): one token gives the
fixed cost per request, more adds the relay of each LM message. Around every
round the script reads each process's CPU time (schedstat), so each row also
says how much CPU the client, the LM and the gateway spent per request.

LM back-ends: by default ``bench/stub_lm.py``, the real LMService protocol
with no engine (it streams its messages at once), so the number is the
gateway's own cost; ``--real-lm`` puts the real LM service with the built-in
tiny model behind it instead (its worker on one core), where vLLM's variance
dominates. The services run as subprocesses in their own sessions and are
always torn down (process groups killed).

Gateways (``bench/gateway_arms.py``): ``--workers 1,2`` and ``--state-store none,private`` start one
gateway per arm (``w1``, ``w2``, ``w1+store``: one process deciding its limits in a private Redis,
``StoreServer``) in front of the same LM, and every round measures every arm's paths (``rest@w2``)
beside the direct ones; the summary then gives each arm's throughput at an added p99 within 50 ms and
what the store adds (``w1+store`` - ``w1``). With workers, ``--grpc-channels`` connections (the kernel
spreads connections over the workers, not calls) and CPU counted for the whole supervisor's session
and its store.

    python bench/gateway.py --quick --json bench/results/gateway-cpu.json --plot bench/results/gateway-cpu.png

Target (issue 5): <= 1 ms p50 added on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp
import gateway_arms
import grpc
import psutil
from gateway_arms import Arm
from machine import machine_info, pct

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.probe import http_ok
from services.up import Service, free_port, grpc_serving, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("direct", "direct-stream", "rest", "rest-stream", "grpc")
# What each gateway path is compared with: the LM called directly with the same body.
BASELINE = {"rest": "direct", "rest-stream": "direct-stream", "grpc": "direct-stream"}
PROMPT = ("Summarize in one sentence: the river runs past the stone bridge and the quiet market, "
          "under a silver evening cloud, toward the harbor.")
TARGET_US = 1000.0
JSON_HEADERS = {"Content-Type": "application/json"}


def start_lm(real: bool, logdir: str, stub_flags: tuple[str, ...] = ()) -> tuple[Service, str]:
    """The real LM (the default model) or ``bench/stub_lm.py`` with ``stub_flags``, once it serves."""
    port = free_port()
    if real:
        from services.cli import default_model

        core = max(os.sched_getaffinity(0))
        argv = [sys.executable, "-m", "services.cli", "lm", "--port", str(port), "--metrics-port", "0",
                "--cpu-cores", str(core), "--model", default_model()]
        name, timeout = "lm", 600.0
    else:
        argv = [sys.executable, "bench/stub_lm.py", "--port", str(port), *stub_flags]
        name, timeout = "stub-lm", 60.0
    lm = Service(name, [], os.path.join(logdir, f"gateway-bench-{name}.log"), command=argv).start()
    addr = f"127.0.0.1:{port}"
    try:
        wait_ready({lm: lambda: grpc_serving(addr)}, time.monotonic() + timeout, poll_s=0.2)
    except BaseException:
        lm.stop()
        raise
    return lm, addr


def start_gateway(lm_addr: str, logdir: str, flags: list[str] | tuple[str, ...] = ("--epd-facts",),
                  log: str = "gateway-bench-gateway.log", workers: int = 1,
                  name: str = "gateway") -> tuple[Service, int, int]:
    """A gateway subprocess on loopback in front of ``lm_addr`` (no encoders), with ``flags`` and
    ``--workers workers``; returns it, its HTTP port and its gRPC port once /health answers and, with
    workers, once every worker listens (a keep-alive pool opened earlier would reach the first only)."""
    port, gport = free_port(), free_port()
    gw = Service(name, ["gateway", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(gport),
                        "--lms", lm_addr, "--encoders", "", "--workers", str(workers), *flags],
                 os.path.join(logdir, log))
    gw.start()

    def ready() -> bool:
        return http_ok(f"http://127.0.0.1:{port}/health") and (
            workers == 1 or listening_workers(gw.proc.pid, (port, gport)) >= workers)

    try:
        wait_ready({gw: ready}, time.monotonic() + 120.0, poll_s=0.2)
    except BaseException:
        gw.stop()
        raise
    return gw, port, gport


def listening_workers(pid: int, ports: tuple[int, ...]) -> int:
    """How many of ``pid``'s child processes listen on every one of ``ports`` (a supervisor's workers)."""
    n = 0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            listening = {c.laddr.port for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
        n += set(ports) <= listening
    return n


def store_pids(pid: int) -> list[int]:
    """The redis-server processes under ``pid`` (a supervisor's private state store)."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "redis" in child.name():
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


class CpuMeter:
    """CPU time (ns, from /proc/*/task/*/schedstat) of this process and of each
    service's session (the service, its threads, and on the real LM its vLLM
    engine processes): ``snapshot()`` -> {"client": ns, name: ns, ...}."""

    def __init__(self, procs: list[Service], more: dict[str, int] | None = None) -> None:
        """``more``: other sessions to count, name -> session id (a state store started in a session of
        its own)."""
        self.sessions = {p.name: p.proc.pid for p in procs} | (more or {})

    @staticmethod
    def _task_ns(pid: int) -> int:
        total = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass  # the thread ended
        except OSError:
            pass
        return total

    def snapshot(self) -> dict[str, int]:
        out = {"client": self._task_ns(os.getpid()), **{name: 0 for name in self.sessions}}
        by_sid = {sid: name for name, sid in self.sessions.items()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    sid = int(f.read().rsplit(")", 1)[1].split()[3])
            except (OSError, ValueError, IndexError):
                continue
            if sid in by_sid:
                out[by_sid[sid]] += self._task_ns(int(entry))
        return out


class Clients:
    """One client per path, all on this process's event loop. Each call returns
    the perf_counter time its last message (or byte) arrived, after checking
    that the answer is whole; checks run after that time is taken."""

    def __init__(self, lm_addr: str, port: int, gport: int, max_tokens: int, grpc_channels: int = 1) -> None:
        self.max_tokens = max_tokens
        # limit=0: as many keep-alive connections as there are concurrent requests.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=300),
                                             timeout=aiohttp.ClientTimeout(total=120))
        self.lm_channel = grpc.aio.insecure_channel(lm_addr)
        # Several channels, each its own connection: with --workers the kernel spreads connections, not calls.
        opts = [("grpc.use_local_subchannel_pool", 1)] if grpc_channels > 1 else []
        self.gw_channels = [grpc.aio.insecure_channel(f"127.0.0.1:{gport}", options=opts)
                            for _ in range(grpc_channels)]
        self.lm = lm_pb2_grpc.LMServiceStub(self.lm_channel)
        self.gws = [gateway_pb2_grpc.GatewayServiceStub(ch) for ch in self.gw_channels]
        self.calls = 0
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.models_url = f"http://127.0.0.1:{port}/v1/models"
        self.fns = {"direct": self.direct, "direct-stream": self.direct_stream, "rest": self.rest,
                    "rest-stream": self.rest_stream, "grpc": self.grpc}

    async def setup(self) -> str:
        async with self.session.get(self.models_url) as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True}
        # Bodies serialized once: the client's JSON encoding is not the gateway's cost.
        self.body = json.dumps(body).encode()
        self.body_stream = json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode()
        self.gw_req = gateway_pb2.OpenAIRequest(body=self.body_stream)
        return model

    async def close(self) -> None:
        await self.session.close()
        await self.lm_channel.close()
        for ch in self.gw_channels:
            await ch.close()

    def _check(self, n: int, finish: str) -> None:
        if n != self.max_tokens or finish != "length":
            raise RuntimeError(f"incomplete answer: {n} tokens, finish_reason {finish!r}")

    def _check_chunks(self, chunks: list[bytes]) -> None:
        """A streamed answer (chat.completion.chunk JSON objects) is whole: its usage chunk counts
        ``max_tokens`` tokens and a choice finished with "length"."""
        n, finish = -1, ""
        for raw in chunks:
            chunk = json.loads(raw)
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {raw[:200]!r}")
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
        self._check(n, finish)

    @staticmethod
    def _sse_data(payload: bytes) -> list[bytes]:
        """The JSON objects of server-sent events (comments and [DONE] left out)."""
        return [line[6:] for line in payload.split(b"\n") if line.startswith(b"data: {")]

    async def direct(self) -> float:
        return await self._direct(self.body)

    async def direct_stream(self) -> float:
        return await self._direct(self.body_stream)

    async def _direct(self, body: bytes) -> float:
        # A fresh request id each time: vLLM refuses two live requests with the same id.
        req = lm_pb2.GenerateRequest(request_id=uuid.uuid4().hex, openai=lm_pb2.OpenAIRequest(api="chat", body=body))
        events, first, last = [], None, None
        async for msg in self.lm.Generate(req, timeout=120):
            if first is None:
                first = msg
            if msg.openai:
                events.append(msg.openai)
            else:
                last = msg
        t = time.perf_counter()
        if first is None or first.http_status != 200:
            raise RuntimeError(f"LM answered {first.http_status if first else 'nothing'}: "
                               f"{first.openai[:200] if first else b''!r}")
        if last is None or not last.HasField("timings"):
            raise RuntimeError("the LM's answer did not end with a last message with timings")
        if body is self.body:
            if len(events) != 1:
                raise RuntimeError(f"the LM answered a non-streaming request in {len(events)} messages")
            out = json.loads(events[0])
            self._check(out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"])
        elif events[-1] != b"data: [DONE]\n\n":
            raise RuntimeError(f"the LM's stream did not end with [DONE]: {events[-1][:200]!r}")
        else:
            self._check_chunks([d for e in events for d in self._sse_data(e)])
        return t

    async def grpc(self) -> float:
        bodies, epd = [], b""
        self.calls += 1
        async for msg in self.gws[self.calls % len(self.gws)].ChatCompletion(self.gw_req, timeout=120):
            if msg.body:
                bodies.append(msg.body)
            epd = msg.epd or epd
        t = time.perf_counter()
        if not epd:
            raise RuntimeError("the gateway's stream did not end with the epd facts")
        self._check_chunks(bodies)
        return t

    async def rest(self) -> float:
        async with self.session.post(self.url, data=self.body, headers=JSON_HEADERS) as r:
            data = await r.read()
            t = time.perf_counter()
            status = r.status
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        out = json.loads(data)
        self._check(out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"])
        return t

    async def rest_stream(self) -> float:
        async with self.session.post(self.url, data=self.body_stream, headers=JSON_HEADERS) as r:
            data = await r.read()  # to the end of the chunked body: time to last byte
            t = time.perf_counter()
            status = r.status
        if status != 200 or not data.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"HTTP {status}: bad stream {data[-200:]!r}")
        self._check_chunks(self._sse_data(data))
        return t


async def closed_loop(fn, concurrency: int, n: int) -> tuple[list[float], float, list[str]]:
    """``concurrency`` workers issue ``n`` requests back to back. Returns the
    latencies (s), the wall time and the errors."""
    lat: list[float] = []
    errors: list[str] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            try:
                lat.append(await fn() - t0)
            except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                errors.append(f"{type(e).__name__}: {e}"[:300])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, time.perf_counter() - t0, errors



async def measure(fns: dict, paths: list[str], concurrencies: list[int], n: int, rounds: int,
                  warmup: int, meter: CpuMeter) -> dict:
    """{(path, concurrency): {"lat": [...], "wall": s, "errors": [...], "cpu_ns": {process: ns}}};
    ``fns``: path label -> a coroutine function making one request (``Clients``' methods)."""
    acc = {(p, c): {"lat": [], "wall": 0.0, "errors": [], "cpu_ns": {}} for p in paths for c in concurrencies}
    for c in concurrencies:
        for p in paths:  # warm-up at this concurrency: connections opened, code paths hot
            _, _, errs = await closed_loop(fns[p], c, max(warmup, c))
            if errs:
                raise RuntimeError(f"warm-up {p} at concurrency {c} failed: {errs[0]}")
        # Every round keeps at least `c` requests, or the concurrency would not be reached.
        r_c = max(1, min(rounds, n // c))
        for r, k in enumerate([n // r_c + (1 if r < n % r_c else 0) for r in range(r_c)]):
            for p in paths[r % len(paths):] + paths[:r % len(paths)]:
                before = meter.snapshot()
                lat, wall, errs = await closed_loop(fns[p], c, k)
                after = meter.snapshot()
                a = acc[(p, c)]
                for name, ns in after.items():
                    a["cpu_ns"][name] = a["cpu_ns"].get(name, 0) + ns - before.get(name, 0)
                a["lat"] += lat
                a["wall"] += wall
                a["errors"] += errs
        print(f"  concurrency {c}: done ({r_c} rounds)", flush=True)
    return acc


def rows_from(acc: dict, paths: list[str], concurrencies: list[int], backend: str, max_tokens: int) -> list[dict]:
    us = lambda x: round(x * 1e6, 1)  # noqa: E731
    rows = []
    for c in concurrencies:
        for p in paths:
            path, arm = gateway_arms.split_label(p)
            base = acc.get((BASELINE.get(path, path), c))
            a = acc[(p, c)]
            lat = a["lat"]
            row = {"path": path, "gateway": arm, "concurrency": c, "max_tokens": max_tokens, "n": len(lat),
                   "p50_us": us(statistics.median(lat)) if lat else None,
                   "p99_us": us(pct(lat, 0.99)) if lat else None, "mean_us": us(statistics.mean(lat)) if lat else None,
                   "rps": round(len(lat) / a["wall"], 1) if a["wall"] else None,
                   "added_p50_us": None, "added_p99_us": None, "backend": backend, "errors": len(a["errors"])}
            if base and base["lat"] and lat:
                row["added_p50_us"] = round(row["p50_us"] - us(statistics.median(base["lat"])), 1)
                row["added_p99_us"] = round(row["p99_us"] - us(pct(base["lat"], 0.99)), 1)
            # CPU per request, by process: where the time goes (the gateway's own share is "gateway").
            row["cpu_us_per_req"] = {name: round(ns / 1e3 / max(1, len(lat)), 1) for name, ns in a["cpu_ns"].items()}
            if a["errors"]:
                row["first_error"] = a["errors"][0]
            rows.append(row)
    return rows


def gateway_name(arm: Arm, only: bool) -> str:
    """The gateway's service name (and CPU column): ``gateway`` when it is the run's only one."""
    return "gateway" if only else f"gateway-{arm.label}"


def cpu_columns(row: dict) -> list[float]:
    """The CPU per request shown for ``row``: the client's, the LM's, and its own gateway's and state store's
    (a direct row: the client's and the LM's)."""
    cpu, gw = row["cpu_us_per_req"], row.get("gateway")
    out = [cpu.get("client"), cpu.get("stub-lm", cpu.get("lm"))]
    if gw:
        out.append(cpu.get(f"gateway-{gw}", cpu.get("gateway")))
        if f"store-{gw}" in cpu:
            out.append(cpu[f"store-{gw}"])
    return out


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'path':<20}{'tok':>4}{'conc':>5}{'n':>6}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}{'req/s':>9}"
           f"{'+p50 us':>10}{'+p99 us':>10}{'err':>5}   cpu us/req: client / lm / gateway / store")
    print(hdr)
    print("-" * len(hdr))
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        name = f"{r['path']}@{r['gateway']}" if r.get("gateway") else r["path"]
        print(f"{name:<20}{r['max_tokens']:>4}{r['concurrency']:>5}{r['n']:>6}"
              f"{fmt(r['p50_us']):>10}{fmt(r['p99_us']):>10}"
              f"{fmt(r['mean_us']):>10}{fmt(r['rps']):>9}{fmt(r['added_p50_us']):>10}{fmt(r['added_p99_us']):>10}"
              f"{r['errors']:>5}   {' / '.join(fmt(v) for v in cpu_columns(r))}")
    print(f"tok = tokens per answer (streamed: LM messages per request, plus 4); latency = send -> last message (REST: last byte);\n"
          f"+p50/+p99 = path - its baseline (rest: direct; rest-stream, grpc: direct-stream) at the same "
          f"concurrency and tokens; target: +p50 <= {TARGET_US:.0f} us;\n"
          f"cpu us/req: CPU time each process spent per request (schedstat), health checks included")


def machine(command: list[str]) -> dict:
    from google import protobuf

    info = {**machine_info(), "grpcio": grpc.__version__, "aiohttp": aiohttp.__version__,
            "protobuf": protobuf.__version__, "command": shlex.join(command)}
    return info


def plot(rows: list[dict], path: str, info: dict, backend: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    tokens = sorted({r["max_tokens"] for r in rows})
    color = {p: f"C{i}" for i, p in enumerate(PATHS)}
    # One line style per token count: the most tokens solid, fewer dashed.
    style = {k: ("-o", "--s", ":^", "-.v")[min(3, len(tokens) - 1 - i)] for i, k in enumerate(tokens)}
    for k in tokens:
        for p in paths:
            rs = sorted((r for r in rows if r["path"] == p and r["max_tokens"] == k and r["p50_us"] is not None),
                        key=lambda r: r["concurrency"])
            xs, label = [r["concurrency"] for r in rs], f"{p}, {k} tok"
            axes[0].plot(xs, [r["p50_us"] / 1e3 for r in rs], style[k], color=color[p], label=label, ms=4)
            if p not in BASELINE:
                continue
            axes[1].plot(xs, [r["added_p50_us"] / 1e3 for r in rs], style[k], color=color[p], label=label, ms=4)
            axes[2].plot(xs, [r["added_p99_us"] / 1e3 for r in rs], style[k], color=color[p], label=label, ms=4)
    low = min([0.0] + [r[k] / 1e3 for r in rows for k in ("added_p50_us", "added_p99_us") if r[k] is not None])
    axes[0].set_title("latency p50 (ms), send -> last message")
    axes[0].set_yscale("log")
    axes[1].set_title("added p50 (ms) = path - its direct baseline")
    axes[2].set_title("added p99 (ms) = path - its direct baseline")
    for ax in axes[1:]:
        ax.axhline(TARGET_US / 1e3, color="red", ls=":", label="1 ms (p50 target)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=low - 0.1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"epd-serve gateway overhead, LM back-end: {backend}; {info['cpu']} ({info['cores']} cores), "
                 f"loopback, {info['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_arms(lm_addr: str, logdir: str, arms: list[Arm], procs: list[Service]) -> tuple[list[tuple], dict]:
    """One gateway per arm in front of ``lm_addr`` (each appended to ``procs`` as it starts, for the caller
    to stop), and a private state store if an arm names one (started here, on the main thread: it dies
    with the thread that started it; the caller stops it). Returns [(arm, port, gport)] and the sessions
    of the state stores for ``CpuMeter`` (each runs in a session of its own)."""
    out, stores = [], {}
    store = None
    if any(a.store == "private" for a in arms):
        from services.gateway.state.store_server import StoreServer

        store = StoreServer().start()
        procs.append(StoreService(store))
    for arm in arms:
        name = gateway_name(arm, len(arms) == 1)
        flags = ["--epd-facts", *(arm.store_flags(store.url, store.password_file) if store else [])]
        gw, port, gport = start_gateway(lm_addr, logdir, flags, f"gateway-bench-{arm.label}.log",
                                        workers=arm.workers, name=name)
        procs.append(gw)
        pids = [store.pid] if arm.store == "private" else store_pids(gw.proc.pid)
        stores.update({f"store-{arm.label}": pid for pid in pids})
        out.append((arm, port, gport))
    return out, stores


class StoreService:
    """A started ``StoreServer`` where the bench keeps its services: ``stop()`` ends it."""

    name = "store"

    def __init__(self, store) -> None:
        self.store = store

    def stop(self) -> None:
        self.store.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-lm", action="store_true", help="the real LM service on the tiny model instead of the stub")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {', '.join(PATHS)}")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per (path, concurrency, tokens) "
                         "(default: 3000 stub, 256 real LM; --quick: 1000 / 128)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per concurrency")
    ap.add_argument("--warmup", type=int, default=0,
                    help="warm-up requests per (path, concurrency), at least the concurrency "
                         "(default: 50 stub, 8 real LM)")
    ap.add_argument("--max-tokens", default="1,16",
                    help="tokens per answer (streamed: an LM message each, plus 4), comma-separated: 1 isolates the per-request "
                         "cost, more adds the per-message relay")
    ap.add_argument("--workers", default="1", help="comma-separated: one gateway per count (--workers N), "
                                                   "measured in the same rounds")
    ap.add_argument("--state-store", default="none",
                    help="comma-separated, from none, private: a one-worker gateway also with a private Redis "
                         "(--state-store); N > 1 workers always use their supervisor's")
    ap.add_argument("--grpc-channels", type=int, default=1,
                    help="gRPC connections to each gateway, used in turn (with workers: the kernel spreads "
                         "connections, not calls)")
    ap.add_argument("--quick", action="store_true", help="fewer requests (about 2 minutes on 2 CPU cores)")
    ap.add_argument("--json", help="write rows here")
    ap.add_argument("--plot", help="write a PNG plot here")
    args = ap.parse_args()

    paths = [p for p in args.paths.split(",") if p]
    if any(p not in PATHS for p in paths) or any(BASELINE[p] not in paths for p in paths if p in BASELINE):
        ap.error(f"--paths must name only {', '.join(PATHS)}, with each path's baseline "
                 f"({', '.join(f'{p}: {b}' for p, b in BASELINE.items())})")
    try:
        arms = gateway_arms.arms([int(w) for w in args.workers.split(",") if w],
                                 [x for x in args.state_store.split(",") if x])
    except ValueError as e:
        ap.error(f"--workers or --state-store: {e}")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    n = args.requests or {(False, False): 3000, (False, True): 1000, (True, False): 256, (True, True): 128}[
        (args.real_lm, args.quick)]
    warmup = args.warmup or (8 if args.real_lm else 50)
    backend = "real-lm" if args.real_lm else "stub"
    logdir = os.path.join(ROOT, "bench", "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    info = machine(["python", os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0],
                    *sys.argv[1:]])

    token_counts = [int(k) for k in args.max_tokens.split(",") if k]
    # SIGTERM unwinds like Ctrl-C, so the finally below still stops the services.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list = []
    rows: list[dict] = []
    try:
        lm, lm_addr = start_lm(args.real_lm, logdir)
        procs.append(lm)
        gateways, stores = start_arms(lm_addr, logdir, arms, procs)
        labels = [p for p in paths if p not in BASELINE] + [gateway_arms.label(p, a) for a, _, _ in gateways
                                                            for p in paths if p in BASELINE]
        print(f"{backend} at {lm_addr}, gateways {', '.join(f'{a.label} http :{p} grpc :{g}' for a, p, g in gateways)}; "
              f"{n} requests per (path, concurrency), {args.rounds} rounds", flush=True)

        meter = CpuMeter([p for p in procs if isinstance(p, Service)], stores)

        async def run(max_tokens: int) -> dict:
            clients = [Clients(lm_addr, port, gport, max_tokens, args.grpc_channels) for _, port, gport in gateways]
            try:
                for c in clients:
                    await c.setup()
                fns = {gateway_arms.label(p, a if p in BASELINE else None): c.fns[p]
                       for (a, _, _), c in zip(gateways, clients) for p in paths}
                return await measure(fns, labels, concurrencies, n, args.rounds, warmup, meter)
            finally:
                for c in clients:
                    await c.close()

        t0 = time.monotonic()
        for k in token_counts:
            print(f" {k} token(s) per answer", flush=True)
            rows += rows_from(asyncio.run(run(k)), labels, concurrencies, backend, k)
        info["measure_s"] = round(time.monotonic() - t0, 1)
    finally:
        for p in reversed(procs):
            p.stop()
    print_table(rows)
    summary = {"p99_limit_ms": gateway_arms.P99_LIMIT_US / 1e3, "frontier": gateway_arms.frontier(rows),
               "store": gateway_arms.store_cost(rows)}
    if len(arms) > 1:
        gateway_arms.print_summary(summary)
    setup = {"backend": backend, "max_tokens": token_counts, "requests": n, "rounds": args.rounds,
             "warmup": warmup, "prompt": PROMPT, "concurrency": concurrencies,
             "gateways": [a.label for a in arms], "grpc_channels": args.grpc_channels,
             "services": {p.name: shlex.join([os.path.basename(p.argv[0]), *p.argv[1:]]) for p in procs
                          if isinstance(p, Service)},
             "target_added_p50_us": TARGET_US}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "setup": setup, "rows": rows,
                       **({"summary": summary} if len(arms) > 1 else {})}, f, indent=1)
    if args.plot:
        if len(arms) > 1:
            gateway_arms.plot(rows, summary, args.plot, f"epd-serve gateway workers and state store, LM back-end: "
                              f"{backend}; {info['cpu']} ({info['cores']} cores), loopback, {info['date'][:10]}")
        else:
            plot(rows, args.plot, info, backend)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
