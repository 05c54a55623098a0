"""Hostile-tenant benchmark: while one tenant attacks the gateway, does another tenant's traffic
keep its success rate and latency, does the gateway stay within its memory limit, and is
everything the attack took given back soon after it ends?

A real gateway runs as a subprocess against ``bench/stub_lm.py`` (the LMService protocol, no
engine), with its default limits unless ``--body-memory-mib``, ``--max-body-readers``,
``--body-timeout-s``, ``--answer-timeout-s`` or ``--lm-max-background`` say otherwise, and
``--api-keys-file`` naming two tenants with random keys: ``legit`` and ``attacker`` (each line
``{"tenant", "key"}``, plus what ``--legit-quota`` / ``--attacker-quota`` add: any JSON object,
merged into that tenant's line, for the quota fields the gateway reads). The run:

1. ``baseline`` (``--phase-s``): the legit tenant alone, a steady ``--legit-rate``, open loop (each
   request sent on schedule, answered or not, so a stall shows as latency), from a few client tasks
   per kind, with its key: ``rest`` (text chat), ``rest-image`` (chat with one tiny PNG data: URL)
   and ``grpc`` (text chat on ``GatewayService/ChatCompletion``), 16 tokens each from the stub;
2. one attack per ``--kinds`` entry, in order (``--phase-s`` each): the same legit load, and the
   attacker's clients (``--clients``; defaults in ``KINDS``) each looping one kind
   (``bench/hostile_attacks.py``), with the attacker's key:

   * ``slow-body``: declares ``Content-Length: 64 MiB`` and sends it at 1.25 x --body-min-rate-kib;
   * ``stream-unread``: a streaming chat (``--stream-tokens`` events) whose answer is never read
     (a 4 KiB receive buffer); ``answer-unread``: the same, non-streaming, an answer of about
     ``--answer-mib``; ``grpc-unread``: a streaming ChatCompletion never read. Each renews its
     request --answer-timeout-s + 2 s after sending it (a FIN from the gateway queues behind the
     unread answer, so the client cannot see a cut; a reset it sees: ``cut``);
   * ``background``: ``POST /v1/responses {"background": true}`` as fast as answered (the stub
     keeps each one in_progress for ``--background-s``);
   * ``grpc-over``: a ChatCompletion message of ``max_body_bytes + 1``; ``grpc-at-limit``: one of
     exactly ``max_body_bytes`` (its body as ``rest-at-limit``'s); ``grpc-stall``: a call whose
     message never comes;
   * ``rest-declared``: a Content-Length of ``max_body_bytes + 1`` (the body follows, fast);
     ``rest-chunked``: a chunked body that grows (1 MiB chunks) until the gateway answers;
     ``rest-at-limit``: a Content-Length of exactly ``max_body_bytes``, sent fast (``--at-limit
     valid``, the default: a chat request with the two largest images the gateway accepts, real PNG
     headers, padded, and a text part that pads it to the byte; ``invalid``: that many bytes of
     ``x``); ``rest-drip``: a 4 KiB body, one byte every ``--drip-s``;
   * ``upload-headers``: ``POST /v1/audio/transcriptions``, a multipart body whose one part has 4 MiB
     of repeated ``content-disposition:`` header lines (the gateway reads part headers for a speech
     upload's routing key, whatever the model).

   At the attack's end every attacker request still open is dropped (its connection reset, its
   call cancelled: those count as ``unanswered``) and the legit tenant pauses; the gateway's
   internal /metrics (its ``--metrics-port``) are then watched until it holds no admission place,
   queued request, body budget or background work (at most ``--recovery-s``), and after
   ``--settle-s`` the next attack begins.

Measured per attack: the legit tenant's success rate on REST (text and image) and on gRPC for the
requests sent during the attack, its latency (send -> whole answer) p50 and p99 against the
baseline's p99; the gateway's RSS peak (the kernel's VmHWM over the attack and its release; psutil
every 50 ms for the plot) against the gateway container's memory limit in
``docker/k8s/base/gateway.yaml``; the time from the attack's end until everything is released
(``epd_gateway_admission_in_flight``, ``_admission_waiting``, ``_body_bytes_held``,
``_background_held``, every 100 ms); how each attacker request was answered. The targets (each
attack's ``targets``): success >= 99 % on REST and on gRPC, p99 within 3x the baseline's, RSS
within the limit, released within ``--release-target-s``.

The gateway runs ``--workers`` processes (default 1). Its cores (``--gateway-cores``, ``gateway_cores``):
by default, with two or more cores and one worker, the gateway gets the last core to itself and every
client (legitimate in a process of their own, hostile in this one, niced by ``--hostile-nice``) and the
stub LM share the others, so the clients' own CPU (sending 86 MiB bodies) is not the gateway's; with
more workers every process shares every core (a worker per core is the point of them). ``all`` shares
every core in either case: ``bench/hostile_workers.py`` compares worker counts so. With workers, RSS
and CPU are summed over the supervisor, its workers and its state store, the peak (VmHWM) is the sum
of each process's own, and /metrics (either worker's) shows every worker's gauges summed. Everything
runs on loopback. The first answer message of each kind of failure is kept (``answer_messages``).

    python bench/hostile.py --json bench/results/hostile-cpu-tenants.json --plot bench/results/hostile-cpu-tenants.png
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import multiprocessing
import os
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aiohttp
import grpc
import psutil
from gateway import machine, start_gateway, start_lm
from hostile_attacks import Hostile, hostile_client, note
from machine import pct

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.child import free_port
from services.gateway.config import BODY_COPIES, GatewayConfig
from services.up import Service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "docker", "k8s", "base", "gateway.yaml")
LEGIT = ("rest", "rest-image", "grpc")
KINDS = {"slow-body": 16, "stream-unread": 96, "answer-unread": 80, "grpc-unread": 96, "background": 32,
         "grpc-over": 8, "grpc-at-limit": 8, "grpc-stall": 16, "rest-declared": 8, "rest-chunked": 8,
         "rest-at-limit": 8, "rest-drip": 16, "upload-headers": 4}
"""Every attack kind, in the order the phases run, and its clients unless --clients says otherwise."""
TENANTS = ("legit", "attacker")
PROMPT = "Summarize in one sentence: the river runs past the stone bridge and the quiet market."
LEGIT_TIMEOUT_S = 60.0
LEGIT_MAX_OUTSTANDING = 2000
WARM_UP_CLIENTS = 16
"""Clients (a connection each, per API) that warm the gateway up: enough that every worker gets some."""
RSS_PERIOD_S, METRICS_PERIOD_S, CPU_PERIOD_S = 0.05, 0.1, 0.5
RELEASE_GAUGES = ("in_flight", "waiting", "held", "background")
MIB = 1 << 20


# -- pure helpers (tests/unit/test_bench_hostile.py) ------------------------------------------


def split_clients(n: int, kinds: list[str]) -> dict[str, int]:
    """``n`` clients over ``kinds``, as evenly as possible, the first kinds one more."""
    return {k: n // len(kinds) + (1 if i < n % len(kinds) else 0) for i, k in enumerate(kinds)}


def grpc_body_len(total: int) -> int:
    """The ``body`` length whose ``OpenAIRequest(body=...)`` serializes to ``total`` bytes (field
    tag, varint length, bytes; an empty body is not serialized at all). Some sizes have none (130:
    127 bytes make 129, 128 make 131): ValueError."""
    for n in range(max(1, total - 11), total):
        if 1 + len(_varint(n)) + n == total:
            return n
    raise ValueError(f"no body length serializes to {total} bytes")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def tiny_png(side: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 80, 40)).save(buf, format="PNG")
    return buf.getvalue()


def at_limit_body(size: int, cfg: GatewayConfig, valid: bool, model: str) -> bytes:
    """Exactly ``size`` bytes. ``valid``: a chat request the gateway accepts and admits, with up to two
    of the largest images it takes (a real PNG header, zero-padded to the largest size whose base64
    passes --max-image-bytes) and a text part padding it to the byte; else ``x`` * size."""
    if not valid:
        return b"x" * size
    # decode_data_url counts base64 padding as data: the largest image that passes is a multiple of 3.
    image = tiny_png()
    image += bytes(cfg.max_image_bytes - cfg.max_image_bytes % 3 - len(image))
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
    content = [{"type": "text", "text": ""}, *[part] * min(2, cfg.max_images)]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    while len(content) > 1 and len(json.dumps(body)) > size:
        content.pop()
    fill = size - len(json.dumps(body))
    if fill < 0:
        raise ValueError(f"{size} bytes hold no chat request")
    content[0]["text"] = "a" * fill
    out = json.dumps(body).encode()
    assert len(out) == size, (len(out), size)
    return out


def k8s_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("1Gi", "512Mi", "2G", "1500M", "1073741824") in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(quantity).strip())
    if not m:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    unit = m.group(2) or ""
    scale = 1 << (10 * " KMGT".index(unit[0])) if unit.endswith("i") else 1000 ** " KMGT".index(unit[:1] or " ")
    return int(float(m.group(1)) * scale)


def manifest_memory_limit(path: str = MANIFEST, container: str = "gateway") -> int | None:
    """The memory limit of ``container`` (the gateway's by default) in the kustomize base's manifest
    ``path``, in bytes (None: none set)."""
    import yaml

    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if doc and doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if c["name"] == container:
                        limit = c.get("resources", {}).get("limits", {}).get("memory")
                        return None if limit is None else k8s_bytes(limit)
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """The gateway's intake metrics from a Prometheus text page: ``held``, ``reading`` and
    ``refused:<reason>``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epd_gateway_body_bytes_held "):
            out["held"] = float(line.split()[1])
        elif line.startswith("epd_gateway_bodies_reading "):
            out["reading"] = float(line.split()[1])
        elif m := re.match(r'epd_gateway_bodies_refused_total\{reason="(\w+)"\} (\S+)', line):
            out[f"refused:{m.group(1)}"] = float(m.group(2))
        elif line.startswith("epd_gateway_admission_in_flight{"):
            out["in_flight"] = out.get("in_flight", 0.0) + float(line.split()[-1])
        elif line.startswith("epd_gateway_admission_waiting "):
            out["waiting"] = float(line.split()[1])
        elif line.startswith("epd_gateway_background_held "):
            out["background"] = float(line.split()[1])
        elif line.startswith("epd_gateway_slow_readers_total "):
            out["slow_readers"] = float(line.split()[1])
    return out


def keys_file_lines(tenants: dict[str, str], quotas: dict[str, dict]) -> list[str]:
    """The gateway's --api-keys-file: one JSON object per tenant, ``{"tenant", "key"}`` and that
    tenant's entries of ``quotas`` (whatever fields the gateway reads, e.g. max_in_flight)."""
    return [json.dumps({"tenant": t, "key": k, **quotas.get(t, {})}) for t, k in tenants.items()]


def released_at(metrics: list[tuple[float, dict]], since: float) -> float | None:
    """The first scrape at or after ``since`` at which the gateway holds nothing of ``RELEASE_GAUGES``
    (admission places, its queue, body budget, background work). None: not within the scrapes given."""
    for t, m in metrics:
        if t >= since and "held" in m and not any(m.get(k, 0.0) for k in RELEASE_GAUGES):
            return t
    return None


def summarize_legit(samples: list[tuple], t0: float, t1: float) -> dict[str, dict]:
    """Per legit kind (and ``all``) for requests sent in [t0, t1): count, success rate, latency p50
    and p99 of the successful ones (ms), and their outcomes. ``samples``: (sent, kind, latency_s,
    outcome), outcome "ok" for an answered request."""
    by: dict[str, list[tuple]] = collections.defaultdict(list)
    for s in samples:
        if t0 <= s[0] < t1:
            by[s[1]].append(s)
            by["all"].append(s)
    out = {}
    for kind, ss in sorted(by.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        ok = [s[2] for s in ss if s[3] == "ok"]
        out[kind] = {"n": len(ss), "ok": len(ok), "success": round(len(ok) / len(ss), 4),
                     "rps": round(len(ss) / (t1 - t0), 1),
                     "p50_ms": round(statistics.median(ok) * 1e3, 2) if ok else None,
                     "p99_ms": round(pct(ok, 0.99) * 1e3, 2) if ok else None,
                     "outcomes": dict(collections.Counter(s[3] for s in ss))}
    return out


def summarize_hostile(events: list[tuple], counts: dict[str, int]) -> dict[str, dict]:
    """Per hostile kind: clients, requests, how they were answered, and the median and longest time
    to the answer (s). ``events``: (sent, answered, kind, outcome)."""
    out = {}
    for kind, n in counts.items():
        es = [e for e in events if e[2] == kind]
        took = [e[1] - e[0] for e in es if e[3] != "unanswered"]
        out[kind] = {"clients": n, "requests": len(es), "outcomes": dict(sorted(collections.Counter(
            e[3] for e in es).items())), "median_s": round(statistics.median(took), 3) if took else None,
            "max_s": round(max(took), 3) if took else None}
    return out


def gateway_cores(cores: list[int], workers: int, choice: str) -> tuple[set[int], set[int]]:
    """The cores of the gateway and of everything else (clients, stub LM), from ``--gateway-cores``:
    ``auto`` (one worker: the last core to itself, as a single event loop uses one; more workers: every
    core, shared), ``all`` (every core, shared: the fair setting for comparing worker counts) or a count
    ``k`` (the last k cores to itself). With one core, or with the gateway on every core, the others
    share all of them."""
    if choice == "auto":
        k = 1 if workers == 1 else len(cores)
    elif choice == "all":
        k = len(cores)
    else:
        k = int(choice) if choice.isdigit() else 0
        if not 1 <= k <= len(cores):
            raise ValueError(f"--gateway-cores {k}: between 1 and {len(cores)} cores, or auto or all")
    gw = set(cores[-k:]) if len(cores) > 1 else set(cores)
    return gw, (set(cores) - gw) or set(cores)


# -- the gateway and what it uses ------------------------------------------------------------


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its child processes (a supervisor's workers and state store) on
    ``cpus`` (threads and processes started later inherit it)."""
    for proc in tree(psutil.Process(pid)):
        try:
            tids = os.listdir(f"/proc/{proc.pid}/task")
        except OSError:
            continue  # the process ended
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass  # the thread ended


def tree(proc: psutil.Process) -> list[psutil.Process]:
    """``proc`` and its descendants (with --workers: the supervisor, its workers and its state store)."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


class Sampler:
    """The gateway's RSS every ``RSS_PERIOD_S`` and its intake metrics every ``METRICS_PERIOD_S``, on
    two threads of their own (the hostile clients' event loop must not delay them). ``mark()`` resets
    the kernel's peak (VmHWM) and returns the peak since the last mark. Where the host's CPU went, every
    ``CPU_PERIOD_S``: the gateway's processes, this benchmark's own (hostile clients, the legit
    clients' process, the stub LM) and the host's whole busy time (so the rest: other users')."""

    def __init__(self, pid: int, metrics_url: str) -> None:
        self.proc, self.url = psutil.Process(pid), metrics_url
        self.rss: list[tuple[float, int, float]] = []  # (time, RSS, CPU seconds so far)
        self.cpu: list[tuple[float, float, float, float, float]] = []
        """(time, CPU seconds so far of: the gateway, this benchmark's processes, the host busy, the host's
        steal)."""
        self.metrics: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, name=f"hostile-{f.__name__}", daemon=True)
                         for f in (self._rss_loop, self._metrics_loop)]

    def start(self) -> Sampler:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _rss_loop(self) -> None:
        procs, found = [self.proc], 0.0
        while not self._stop.wait(RSS_PERIOD_S):
            if time.monotonic() - found > 1.0:  # a worker replaced: looked for once a second
                procs, found = tree(self.proc), time.monotonic()
            rss = cpu = 0.0
            for p in procs:
                try:
                    rss, cpu = rss + p.memory_info().rss, cpu + sum(p.cpu_times()[:2])
                except psutil.Error:
                    if p is self.proc:
                        return  # the gateway is gone
            self.rss.append((time.monotonic(), int(rss), cpu))
            if not self.cpu or time.monotonic() - self.cpu[-1][0] >= CPU_PERIOD_S:
                self.cpu.append(self._cpu_sample(cpu, {p.pid for p in procs}))

    @staticmethod
    def _cpu_sample(gateway: float, gateway_pids: set[int]) -> tuple[float, float, float, float, float]:
        own = 0.0
        for p in tree(psutil.Process()):
            if p.pid not in gateway_pids:
                try:
                    own += sum(p.cpu_times()[:2])
                except psutil.Error:
                    pass  # it ended
        h = psutil.cpu_times()
        return (time.monotonic(), gateway, own, h.user + h.nice + h.system + h.irq + h.softirq,
                getattr(h, "steal", 0.0))

    def _metrics_loop(self) -> None:
        while not self._stop.wait(METRICS_PERIOD_S):
            t = time.monotonic()
            m = self.scrape()
            m["scrape_s"] = time.monotonic() - t  # a GET with no body: how long the event loop takes to answer
            self.metrics.append((t, m))

    def scrape(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(self.url, timeout=30) as r:
                return parse_metrics(r.read().decode())
        except OSError:
            return {}

    def mark(self) -> int:
        """The peak RSS (VmHWM) since the last mark, in bytes, summed over the gateway's processes (with
        --workers: each worker's own peak, so at least the peak of their sum); resets them (clear_refs 5)."""
        return sum(mark_hwm(p.pid) for p in tree(self.proc))

    def window(self, t0: float, t1: float) -> dict:
        xs = [s for s in self.rss if t0 <= s[0] < t1]
        rss = [s[1] for s in xs]
        return {"rss_peak_mib": round(max(rss) / MIB, 1) if xs else None,
                "rss_steady_mib": round(statistics.median(rss) / MIB, 1) if xs else None,
                "gateway_cpu_pct": round(100 * (xs[-1][2] - xs[0][2]) / (xs[-1][0] - xs[0][0]))
                if len(xs) > 1 else None, **cpu_shares([c for c in self.cpu if t0 <= c[0] < t1])}


def cpu_shares(samples: list[tuple]) -> dict[str, int | None]:
    """Where the CPU went between the first and last of ``samples`` ((time, gateway, this benchmark's
    processes, host busy, host steal), CPU seconds so far), in % of one core: ``bench_cpu_pct`` (clients
    and stub LM), ``host_cpu_pct`` (every process), ``other_cpu_pct`` (the host's less the gateway's and
    the benchmark's: other users of the host), ``steal_pct`` (the hypervisor's)."""
    if len(samples) < 2:
        return {"bench_cpu_pct": None, "host_cpu_pct": None, "other_cpu_pct": None, "steal_pct": None}
    (t0, g0, b0, h0, s0), (t1, g1, b1, h1, s1) = samples[0], samples[-1]
    pct_of = lambda v: round(100 * v / (t1 - t0))  # noqa: E731
    return {"bench_cpu_pct": pct_of(b1 - b0), "host_cpu_pct": pct_of(h1 - h0),
            "other_cpu_pct": pct_of(max(0.0, (h1 - h0) - (g1 - g0) - (b1 - b0))), "steal_pct": pct_of(s1 - s0)}


def mark_hwm(pid: int) -> int:
    """Process ``pid``'s peak RSS (VmHWM) since its last reset, in bytes; resets it (0: it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return hwm
    except (OSError, StopIteration):
        return 0


# -- legitimate clients (a process of their own) ---------------------------------------------


class Legit:
    """One request of each legit kind; ``call(kind)`` -> "ok" or what went wrong."""

    def __init__(self, port: int, gport: int, model: str, key: str) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=LEGIT_TIMEOUT_S))
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gport}")
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        text = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
        image = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
        with_image = dict(text, messages=[{"role": "user", "content": [
            {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": image}}]}])
        self.bodies = {"rest": json.dumps(text).encode(), "rest-image": json.dumps(with_image).encode()}
        self.grpc_req = gateway_pb2.OpenAIRequest(body=self.bodies["rest"])
        self.details: dict[str, str] = {}
        """The first answer's message for each failure (outcome -> text)."""

    async def call(self, kind: str) -> str:
        try:
            if kind == "grpc":
                n = 0
                async for msg in self.stub.ChatCompletion(self.grpc_req, timeout=LEGIT_TIMEOUT_S,
                                                          metadata=self.metadata):
                    n += bool(msg.body)
                return "ok" if n else "empty"
            async with self.session.post(self.url, data=self.bodies[kind], headers=self.headers) as r:
                data = await r.read()
            if r.status == 200 and b'"choices"' in data:
                return "ok"
            return note(self.details, str(r.status), data.decode(errors="replace"))
        except grpc.aio.AioRpcError as e:
            return note(self.details, e.code().name, e.details() or "")
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientError as e:
            return type(e).__name__

    async def close(self) -> None:
        await self.session.close()
        await self.channel.close()


async def _legit_load(port, gport, model, key, tasks_per_kind, rate, begin, stop, pause) -> tuple[list[tuple], dict]:
    """Open loop from ``begin`` until ``stop`` (a multiprocessing Event) is set, skipping its turns
    while ``pause`` is set: every task sends on its schedule whether or not its last request has been
    answered, so a gateway that stalls shows as slow or failed requests, not as fewer of them. More
    than ``LEGIT_MAX_OUTSTANDING`` unanswered at once: the next is not sent ("not sent"). ``begin``: a
    shared value, 0 until the parent sets the start (monotonic) once this process said it is ready
    (``begin`` set to -1 here): a start chosen before a slow import would put the schedule's first
    seconds into one burst."""
    legit = Legit(port, gport, model, key)
    for kind in LEGIT:  # its connections opened and its code paths run before the schedule starts
        await legit.call(kind)
    begin.value = -1.0
    while begin.value <= 0:
        await asyncio.sleep(0.01)
    start = begin.value
    samples: list[tuple] = []
    flying: set[asyncio.Task] = set()
    interval = len(LEGIT) * tasks_per_kind / rate

    async def one(kind: str) -> None:
        sent, t = time.monotonic(), time.perf_counter()
        outcome = await legit.call(kind)
        samples.append((sent, kind, time.perf_counter() - t, outcome))

    async def task(kind: str, offset: float) -> None:
        nxt = start + offset
        while not stop.is_set():
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            if pause.is_set():
                pass
            elif len(flying) >= LEGIT_MAX_OUTSTANDING:
                samples.append((time.monotonic(), kind, 0.0, "not sent"))
            else:
                t = asyncio.ensure_future(one(kind))
                flying.add(t)
                t.add_done_callback(flying.discard)
            nxt += interval

    n = len(LEGIT) * tasks_per_kind
    try:
        await asyncio.gather(*(task(k, i * interval / n) for i, k in enumerate(LEGIT * tasks_per_kind)))
        await asyncio.gather(*list(flying))
    finally:
        await legit.close()
    return samples, legit.details


def legit_worker(conn, *args) -> None:
    """Entry of the legit tenant's process: runs the load, sends the samples back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    conn.send(asyncio.run(_legit_load(*args)))  # (samples, details)
    conn.close()


# -- the run -------------------------------------------------------------------------------


async def warm_up(port: int, gport: int, key: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/models",
                                                   headers={"Authorization": f"Bearer {key}"}) as r:
        model = (await r.json())["data"][0]["id"]
    for _ in range(WARM_UP_CLIENTS):  # new connections each time: with --workers, the kernel spreads them over all
        legit = Legit(port, gport, model, key)
        try:
            for _ in range(4):
                for kind in LEGIT:
                    if (outcome := await legit.call(kind)) != "ok":
                        raise RuntimeError(f"warm-up {kind} request failed: {outcome}")
        finally:
            await legit.close()
    return model


async def attack_phase(hostile: Hostile, kind: str, n: int, phase_s: float, events: list) -> None:
    """``n`` clients of ``kind`` for ``phase_s``; then every request still open is cancelled (its
    connection reset, its call cancelled): the attacker is gone."""
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(hostile_client(hostile, kind, hostile.channel() if kind.startswith("grpc")
                                                  else None, stop, events)) for _ in range(n)]
    await asyncio.sleep(phase_s)
    stop.set()
    pending = set(tasks)
    while pending:  # a cancel that wait_for swallowed is sent again
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    await hostile.close()


def run(args, cfg: GatewayConfig, flags: list[str], keys: dict[str, str]) -> dict:
    logdir = os.path.join(ROOT, "bench", "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    keys_path = os.path.join(logdir, "hostile-bench-keys.jsonl")
    with open(os.open(keys_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("\n".join(keys_file_lines(keys, args.quotas)) + "\n")
    gw_cores, client_cores = gateway_cores(sorted(os.sched_getaffinity(0)), args.workers, args.gateway_cores)
    pin(os.getpid(), client_cores)  # the stub LM and the legit process inherit it
    procs: list[Service] = []
    try:
        lm, lm_addr = start_lm(False, logdir, ("--background-s", str(args.background_s)))
        procs.append(lm)
        metrics_port = free_port()  # the internal port: the body budget and admission gauges are not public
        gw, port, gport = start_gateway(lm_addr, logdir, [*flags, "--api-keys-file", keys_path,
                                                          "--metrics-port", str(metrics_port)],
                                        log="hostile-bench-gateway.log", workers=args.workers)
        procs.append(gw)
        pin(gw.proc.pid, gw_cores)
        model = asyncio.run(warm_up(port, gport, keys["legit"]))
        sampler = Sampler(gw.proc.pid, f"http://127.0.0.1:{metrics_port}/metrics").start()
        time.sleep(2.0)
        idle = statistics.median(r for _, r, _ in sampler.rss[-20:])
        at = at_limit_body(cfg.max_body_bytes, cfg, args.at_limit == "valid", model)
        grpc_at = gateway_pb2.OpenAIRequest(body=at_limit_body(grpc_body_len(cfg.max_body_bytes), cfg,
                                                               args.at_limit == "valid", model)).SerializeToString()
        grpc_over = gateway_pb2.OpenAIRequest(body=bytes(grpc_body_len(cfg.max_body_bytes + 1))).SerializeToString()
        hostile = Hostile(port, gport, cfg, keys["attacker"], model, args.drip_s, at, grpc_at, grpc_over,
                          args.answer_mib, args.stream_tokens)
        print(f"gateway pid {gw.proc.pid} ({args.workers} worker(s)) on cpu {sorted(gw_cores)}, clients and stub LM "
              f"on {sorted(client_cores)}; "
              f"idle RSS {idle / MIB:.0f} MiB; attacks {args.counts}", flush=True)

        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        stop, pause, begin = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        worker = ctx.Process(target=legit_worker, name="hostile-legit", daemon=True,
                             args=(send, port, gport, model, keys["legit"], args.legit_tasks, args.legit_rate, begin,
                                   stop, pause))
        worker.start()
        deadline = time.monotonic() + LEGIT_TIMEOUT_S
        while begin.value == 0 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # the legit process imports and builds its clients
        if begin.value == 0:
            raise RuntimeError("the legit clients' process did not start")
        t0 = time.monotonic() + 0.5
        begin.value = t0
        # The hostile clients yield the client cores to the legit clients and the stub LM: what the
        # legit latency shows is then the gateway's doing, not this process's 86 MiB copies.
        os.nice(args.hostile_nice)
        phases: list[dict] = []
        events: list[tuple] = []

        async def timeline() -> None:
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            sampler.mark()
            await asyncio.sleep(args.phase_s)
            t1 = time.monotonic()
            pause.set()
            phases.append({"phase": "baseline", "t0": t0, "t1": t1, "hwm": sampler.mark()})
            print(f"  t={t1 - t0:6.1f} s: baseline done", flush=True)
            await asyncio.sleep(args.settle_s)
            for kind in args.kinds:
                a0 = time.monotonic()
                pause.clear()
                await attack_phase(hostile, kind, args.counts[kind], args.phase_s, events)
                a1 = time.monotonic()
                pause.set()  # the legit tenant pauses too: whatever is still held after a1 is the attack's
                while time.monotonic() < a1 + args.recovery_s:
                    await asyncio.sleep(0.2)
                    if released_at(sampler.metrics, a1) is not None:
                        break
                await asyncio.sleep(args.settle_s)
                r1 = time.monotonic()
                phases.append({"phase": kind, "t0": a0, "t1": a1, "t2": r1, "hwm": sampler.mark(),
                               "released": released_at([x for x in sampler.metrics if x[0] < r1], a1)})
                rel = phases[-1]["released"]
                took = f"after {rel - a1:.1f} s" if rel else f"NOT within {args.recovery_s:g} s"
                print(f"  t={r1 - t0:6.1f} s: {kind} done; released {took}", flush=True)

        asyncio.run(timeline())
        stop.set()
        if not recv.poll(LEGIT_TIMEOUT_S + 10):
            raise RuntimeError("the legit clients' process sent no samples")
        samples, legit_details = recv.recv()
        worker.join(10)
        time.sleep(0.5)
        sampler.stop()
        gateway_alive = gw.alive()
    finally:
        for p in reversed(procs):
            p.stop()
    return {"samples": samples, "events": events, "details": {"legit": legit_details, "hostile": hostile.details},
            "idle": idle, "t0": t0, "phases": phases, "sampler": sampler, "gateway_alive": gateway_alive,
            "cores": {"gateway": sorted(gw_cores), "clients": sorted(client_cores)}}


def legit_row(samples: list[tuple], t0: float, t1: float) -> dict:
    """The legit tenant in [t0, t1): REST (text and image together) and gRPC success, and latency."""
    s = summarize_legit(samples, t0, t1)
    rest = [x for x in samples if t0 <= x[0] < t1 and x[1] != "grpc"]
    return {"rest_success": round(sum(x[3] == "ok" for x in rest) / len(rest), 4) if rest else None,
            "grpc_success": s.get("grpc", {}).get("success"), "p50_ms": s.get("all", {}).get("p50_ms"),
            "p99_ms": s.get("all", {}).get("p99_ms"), "by_kind": s}


def report(res: dict, args, cfg: GatewayConfig, limit: int | None) -> dict:
    sampler, t0, ph = res["sampler"], res["t0"], res["phases"]
    rel = lambda t: round(t - t0, 2)  # noqa: E731
    base = {"t0_s": 0.0, "t1_s": rel(ph[0]["t1"]), **legit_row(res["samples"], ph[0]["t0"], ph[0]["t1"]),
            **sampler.window(ph[0]["t0"], ph[0]["t1"]), "rss_hwm_mib": round(ph[0]["hwm"] / MIB, 1)}
    attacks = []
    for p in ph[1:]:
        row = legit_row(res["samples"], p["t0"], p["t1"])
        peaks = {k: max((m.get(k, 0.0) for t, m in sampler.metrics if p["t0"] <= t < p["t2"]), default=0.0)
                 for k in RELEASE_GAUGES}
        released_s = round(p["released"] - p["t1"], 2) if p["released"] else None
        hwm = p["hwm"]
        row.update({
            "attack": p["phase"], "clients": args.counts[p["phase"]], "t0_s": rel(p["t0"]), "t1_s": rel(p["t1"]),
            "t2_s": rel(p["t2"]), "p99_vs_baseline": round(row["p99_ms"] / base["p99_ms"], 2)
            if row["p99_ms"] and base["p99_ms"] else None,
            **sampler.window(p["t0"], p["t2"]), "rss_hwm_mib": round(hwm / MIB, 1),
            "rss_at_start_mib": next((round(r / MIB, 1) for t, r, _ in sampler.rss if t >= p["t0"]), None),
            "gauges_peak": {k: (round(v / MIB, 1) if k == "held" else v) for k, v in peaks.items()},
            "released_s": released_s,
            "hostile": summarize_hostile([e for e in res["events"] if p["t0"] <= e[0] < p["t2"]],
                                         {p["phase"]: args.counts[p["phase"]]})[p["phase"]]})
        row["targets"] = {
            "rest_99": (row["rest_success"] or 0) >= 0.99, "grpc_99": (row["grpc_success"] or 0) >= 0.99,
            "p99_3x": row["p99_vs_baseline"] is not None and row["p99_vs_baseline"] <= 3.0,
            "rss_k8s": None if limit is None else hwm <= limit,
            "released": released_s is not None and released_s <= args.release_target_s}
        attacks.append(row)
    held = [(t, m["held"]) for t, m in sampler.metrics if "held" in m]
    m0, m1 = sampler.metrics[0][1] if sampler.metrics else {}, sampler.metrics[-1][1] if sampler.metrics else {}
    return {
        "baseline": base,
        "attacks": attacks,
        "server_counters": {k: int(m1.get(k, 0) - m0.get(k, 0)) for k in m1
                            if k.startswith("refused:") or k == "slow_readers"},
        "answer_messages": res["details"],
        "memory": {"idle_rss_mib": round(res["idle"] / MIB, 1), "body_memory_mib": cfg.body_memory_mib,
                   "k8s_limit_mib": round(limit / MIB, 1) if limit else None,
                   "peak_rss_mib": round(max(p["hwm"] for p in ph) / MIB, 1),
                   "peak_budget_held_mib": round(max((h for _, h in held), default=0) / MIB, 1),
                   "gateway_alive_at_end": res["gateway_alive"]},
        "rss_samples": [(rel(t), round(r / MIB, 1)) for t, r, _ in sampler.rss[::2]],
        "gauge_samples": [(rel(t), round(m.get("held", 0) / MIB, 2), m.get("in_flight", 0), m.get("waiting", 0),
                           m.get("background", 0)) for t, m in sampler.metrics],
        "legit_samples": [(rel(s[0]), s[1], round(s[2] * 1e3, 1), s[3]) for s in res["samples"]],
    }


SERIES = ("rss_samples", "gauge_samples", "legit_samples")
"""Time series (s since the baseline began, values): written one line each, the rest indented.
``gauge_samples``: (s, body budget held MiB, admission in flight, waiting, background held)."""


def write_json(path: str, doc: dict) -> None:
    text = json.dumps({k: v for k, v in doc.items() if k not in SERIES}, indent=1)
    series = [f' "{k}": {json.dumps(doc[k], separators=(",", ":"))}' for k in SERIES if k in doc]
    with open(path, "w") as f:
        f.write(text[:-2] + "".join(",\n" + x for x in series) + "\n}\n")


def print_table(out: dict) -> None:
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    pc = lambda v: fmt(None if v is None else 100 * v)  # noqa: E731
    yes = lambda v: "-" if v is None else ("yes" if v else "NO")  # noqa: E731
    b = out["baseline"]
    hdr = (f"{'attack':<15}{'clients':>8}{'REST ok%':>9}{'gRPC ok%':>9}{'p50 ms':>8}{'p99 ms':>9}{'p99 x':>7}"
           f"{'RSS MiB':>14}{'released':>9}  {'met: REST gRPC p99 RSS rel':<27}hostile answers")
    print(hdr + "\n" + "-" * (len(hdr) + 20))
    print(f"{'baseline':<15}{'-':>8}{pc(b['rest_success']):>9}{pc(b['grpc_success']):>9}{fmt(b['p50_ms']):>8}"
          f"{fmt(b['p99_ms']):>9}{'1.0':>7}{fmt(b['rss_hwm_mib']):>14}{'-':>9}")
    for a in out["attacks"]:
        t = a["targets"]
        met = " ".join(f"{yes(t[k]):>{w}}" for k, w in (("rest_99", 4), ("grpc_99", 4), ("p99_3x", 3),
                                                            ("rss_k8s", 3), ("released", 3)))
        rel = fmt(a["released_s"]) + " s" if a["released_s"] is not None else "NO"
        print(f"{a['attack']:<15}{a['clients']:>8}{pc(a['rest_success']):>9}{pc(a['grpc_success']):>9}"
              f"{fmt(a['p50_ms']):>8}{fmt(a['p99_ms']):>9}{fmt(a['p99_vs_baseline']):>7}"
              f"{fmt(a['rss_at_start_mib'], '{:.0f}') + ' -> ' + fmt(a['rss_hwm_mib'], '{:.0f}'):>14}"
              f"{rel:>9}  {'     ' + met:<27}{a['hostile']['outcomes']}")
    print("\nlegit failures during each attack:")
    for a in out["attacks"]:
        fails = {k: {o: n for o, n in s["outcomes"].items() if o != "ok"} for k, s in a["by_kind"].items()
                 if k != "all"}
        fails = {k: v for k, v in fails.items() if v}
        if fails:
            print(f"  {a['attack']}: {fails}")
    print(f"gateway's own counters over the run: {out['server_counters']}")
    for side, details in out["answer_messages"].items():
        for key, text in sorted(details.items()):
            print(f"  {side} {key}: {text[:150]}")
    m = out["memory"]
    print(f"\nmemory: idle RSS {m['idle_rss_mib']} MiB; k8s limit {m['k8s_limit_mib']} MiB; peak RSS "
          f"{m['peak_rss_mib']} MiB (VmHWM); body budget {m['body_memory_mib']:g} MiB, held at most "
          f"{m['peak_budget_held_mib']} MiB; gateway alive at end: {m['gateway_alive_at_end']}")
    print("ok% and latency: the legit tenant's requests sent during the attack (latency = send -> whole answer, "
          "successful ones); p99 x = vs its baseline; RSS = the gateway's RSS as the attack began -> its VmHWM over the "
          "attack and its release (a peak can be what the previous attack left); "
          "released = from the attack's end (the attacker's requests reset or cancelled, the legit tenant paused) until "
          "the gateway holds no admission place, queued request, body budget or background work")


def plot(out: dict, path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx, lx) = plt.subplots(3, 1, figsize=(14, 9), sharex=True, height_ratios=[2, 2, 3])
    m = out["memory"]
    spans = [("baseline", out["baseline"]["t0_s"], out["baseline"]["t1_s"])] + \
        [(a["attack"], a["t0_s"], a["t1_s"]) for a in out["attacks"]]
    for i, (name, a, b) in enumerate(spans):
        for x in (ax, gx, lx):
            x.axvspan(a, b, color="C2" if i == 0 else "C3", alpha=0.06 if i % 2 else 0.12)
        ax.text((a + b) / 2, 0.98, name, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7,
                rotation=90)
    if out["rss_samples"]:
        ax.plot(*zip(*out["rss_samples"]), color="k", lw=1, label="gateway RSS")
    g = out["gauge_samples"]
    if g:
        ax.plot([x[0] for x in g], [x[1] for x in g], color="C1", lw=1, label="body budget held (/metrics)")
        for j, (name, c) in enumerate((("admission in flight", "C0"), ("admission waiting", "C4"),
                                       ("background held", "C5")), start=2):
            gx.plot([x[0] for x in g], [x[j] for x in g], color=c, lw=1, label=name)
    if m["k8s_limit_mib"]:
        ax.axhline(m["k8s_limit_mib"], color="red", ls=":", label=f"k8s limit {m['k8s_limit_mib']:.0f} MiB")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="center left")
    gx.set_ylabel("requests (/metrics)")
    gx.legend(fontsize=7, loc="upper left")
    for i, kind in enumerate(LEGIT):
        ok = [(s[0], s[2]) for s in out["legit_samples"] if s[1] == kind and s[3] == "ok"]
        bad = [(s[0], max(s[2], 1.0)) for s in out["legit_samples"] if s[1] == kind and s[3] != "ok"]
        if ok:
            lx.scatter(*zip(*ok), s=3, color=f"C{i}", label=f"legit {kind} ok")
        if bad:
            lx.scatter(*zip(*bad), s=14, marker="x", color=f"C{i}", label=f"legit {kind} failed")
    lx.set_yscale("log")
    lx.set_ylabel("legit latency (ms)")
    lx.set_xlabel("s since the baseline began (shaded: baseline, then each attack; gaps: its recovery)")
    lx.legend(fontsize=7, ncol=3, loc="upper left")
    for x in (ax, gx, lx):
        x.grid(alpha=0.3, which="both")
    fig.suptitle(f"epd-serve gateway: a legit tenant while an attacker tenant attacks; {info['cpu']} "
                 f"({info['cores']} cores), {info['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, in order, from {', '.join(KINDS)}")
    ap.add_argument("--clients", default="", help="kind=n,... overriding the attacker's clients per kind "
                                                  f"(default {', '.join(f'{k}={n}' for k, n in KINDS.items())})")
    ap.add_argument("--attacker-quota", default="{}", help="JSON object merged into the attacker's keys-file line "
                                                           '(e.g. \'{"max_in_flight": 8}\')')
    ap.add_argument("--legit-quota", default="{}", help="JSON object merged into the legit tenant's line")
    ap.add_argument("--at-limit", choices=("valid", "invalid"), default="valid",
                    help="at-limit bodies: a valid chat request with two largest images, or invalid JSON")
    ap.add_argument("--phase-s", type=float, default=0,
                    help="baseline and each attack (default --answer-timeout-s + 5, so the answer deadline acts "
                         "within each attack; --quick 4)")
    ap.add_argument("--recovery-s", type=float, default=0,
                    help="longest wait for the release after each attack (default --answer-timeout-s + 10)")
    ap.add_argument("--settle-s", type=float, default=1.0, help="a pause after each release")
    ap.add_argument("--release-target-s", type=float, default=5.0, help="the release target (s)")
    ap.add_argument("--legit-rate", type=float, default=60.0, help="legitimate requests per second, all kinds")
    ap.add_argument("--legit-tasks", type=int, default=2, help="client tasks per legit kind")
    ap.add_argument("--drip-s", type=float, default=0.1, help="rest-drip: seconds between the bytes of a slow upload")
    ap.add_argument("--answer-mib", type=float, default=4.0, help="answer-unread: each unread answer's size")
    ap.add_argument("--stream-tokens", type=int, default=200_000, help="stream-unread, grpc-unread: events asked for")
    ap.add_argument("--background-s", type=float, default=2.0, help="the stub LM's time per background response")
    for flag in ("body-memory-mib", "max-body-readers", "body-timeout-s", "answer-timeout-s", "lm-max-background"):
        ap.add_argument(f"--{flag}", type=int if flag in ("max-body-readers", "lm-max-background") else float,
                        default=None, help="passed to the gateway (default: the gateway's own)")
    ap.add_argument("--hostile-nice", type=int, default=10, help="niceness of the hostile clients' process")
    ap.add_argument("--workers", type=int, default=1, help="the gateway's --workers")
    ap.add_argument("--gateway-cores", default="auto",
                    help="auto (one worker: the last core to itself; more: every core, shared), all (every core, "
                         "shared with the clients and the stub LM) or k (the last k cores to itself)")
    ap.add_argument("--no-pin", dest="gateway_cores", action="store_const", const="all",
                    help="the same as --gateway-cores all")
    ap.add_argument("--quick", action="store_true", help="4 s phases")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG plot here")
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    try:
        gateway_cores(sorted(os.sched_getaffinity(0)), args.workers, args.gateway_cores)
    except ValueError as e:
        ap.error(str(e))
    if not args.kinds or any(k not in KINDS for k in args.kinds):
        ap.error(f"--kinds must name some of {', '.join(KINDS)}")
    try:
        args.counts = dict(KINDS) | {k: int(n) for k, _, n in (x.partition("=") for x in args.clients.split(",") if x)}
        args.quotas = {"attacker": json.loads(args.attacker_quota), "legit": json.loads(args.legit_quota)}
    except ValueError as e:
        ap.error(f"--clients or a quota: {e}")
    if any(not isinstance(q, dict) for q in args.quotas.values()):
        ap.error("a quota must be a JSON object")
    given = {f: getattr(args, f) for f in ("body_memory_mib", "max_body_readers", "body_timeout_s", "answer_timeout_s",
                                           "lm_max_background") if getattr(args, f) is not None}
    cfg = GatewayConfig(lms="127.0.0.1:1", **given)
    flags = [x for f, v in given.items() for x in (f"--{f.replace('_', '-')}", str(v))]
    args.phase_s = args.phase_s or (4.0 if args.quick else cfg.answer_timeout_s + 5)
    args.recovery_s = args.recovery_s or cfg.answer_timeout_s + 10
    limit = manifest_memory_limit()
    info = machine(["python", os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0],
                    *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    keys = {t: base64.urlsafe_b64encode(os.urandom(24)).decode() for t in TENANTS}
    print(f"max_body_bytes {cfg.max_body_bytes} ({cfg.max_body_bytes / MIB:.1f} MiB), body budget "
          f"{cfg.body_memory_mib:g} MiB, body timeout {cfg.body_timeout_s:g} s (min {cfg.body_min_rate_kib:g} KiB/s), "
          f"answer timeout {cfg.answer_timeout_s:g} s (min {cfg.answer_min_rate_kib:g} KiB/s), "
          f"{cfg.lm_max_outstanding} per LM in flight, {cfg.lm_max_background} background; phases {args.phase_s:g} s, "
          f"release awaited up to {args.recovery_s:g} s", flush=True)
    t = time.monotonic()
    res = run(args, cfg, flags, keys)
    info["measure_s"] = round(time.monotonic() - t, 1)
    info["cores_used"] = res["cores"]
    out = report(res, args, cfg, limit)
    print_table(out)
    setup = {"kinds": args.kinds, "clients": {k: args.counts[k] for k in args.kinds}, "tenants": list(TENANTS),
             "keys_file": [json.loads(x) | {"key": "(random)"} for x in keys_file_lines(keys, args.quotas)],
             "at_limit": args.at_limit, "phase_s": args.phase_s, "recovery_s": args.recovery_s,
             "settle_s": args.settle_s, "release_target_s": args.release_target_s, "legit_rate": args.legit_rate,
             "legit_tasks_per_kind": args.legit_tasks, "drip_s": args.drip_s, "answer_mib": args.answer_mib,
             "stream_tokens": args.stream_tokens, "stub_background_s": args.background_s,
             "hostile_nice": args.hostile_nice, "gateway_flags": flags, "workers": args.workers,
             "gateway_cores": args.gateway_cores,
             "max_body_bytes": cfg.max_body_bytes, "body_memory_mib": cfg.body_memory_mib,
             "max_body_readers": cfg.max_body_readers, "body_timeout_s": cfg.body_timeout_s,
             "body_min_rate_kib": cfg.body_min_rate_kib, "answer_timeout_s": cfg.answer_timeout_s,
             "answer_min_rate_kib": cfg.answer_min_rate_kib, "lm_max_outstanding": cfg.lm_max_outstanding,
             "lm_max_background": cfg.lm_max_background, "admission_queue": cfg.admission_queue,
             "body_copies": BODY_COPIES, "k8s_manifest": os.path.relpath(MANIFEST, ROOT)}
    if args.json:
        write_json(args.json, {"machine": info, "setup": setup, **out})
    if args.plot:
        plot(out, args.plot, info)
    return 0 if res["gateway_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
