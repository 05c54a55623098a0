"""Hostile-client benchmark: does the gateway hold its memory bound, and keep answering
legitimate requests, while clients abuse its request bodies?

A real gateway runs as a subprocess against ``bench/stub_lm.py`` (the LMService protocol, no
engine), with the default intake limits (``services/gateway/intake.py``) unless ``--body-memory-mib``,
``--max-body-readers`` or ``--body-timeout-s`` say otherwise. Three phases, one run:

1. ``baseline`` (``--phase-s``): legitimate requests only, a steady ``--legit-rate``, open loop
   (each sent on schedule, answered or not, so a stall shows as latency), from a few client tasks
   per kind: ``rest`` (text chat), ``rest-image`` (chat with one tiny PNG data: URL) and ``grpc``
   (text chat on ``GatewayService/ChatCompletion``), 16 tokens each from the stub;
2. ``attack`` (``--phase-s``): the same legitimate load plus ``--hostile`` clients split evenly
   over ``--kinds``, each looping for the phase:

   * ``rest-declared``: a Content-Length of ``max_body_bytes + 1`` (the body follows, fast);
   * ``rest-chunked``: a chunked body that grows (1 MiB chunks) until the gateway answers;
   * ``rest-at-limit``: a Content-Length of exactly ``max_body_bytes``, sent fast. ``--at-limit
     valid`` (default): a chat request with the two largest images the gateway accepts (real PNG
     headers, padded) and a text part that pads it to the byte; ``invalid``: that many bytes of
     ``x`` (refused 400 as JSON);
   * ``rest-drip``: a 4 KiB body, one byte every ``--drip-s``;
   * ``grpc-over``: a ChatCompletion message of ``max_body_bytes + 1``;
   * ``grpc-at-limit``: a message of exactly ``max_body_bytes`` (its body as ``rest-at-limit``'s);
   * ``grpc-stall`` (not in the default mix): a call whose message never comes.

3. ``recovery`` (``--recovery-s``, by default ``--body-timeout-s`` + 5 s so every slow upload
   started in the attack has been answered): legitimate load only; hostile requests started in
   the attack finish (no new ones). What is still unanswered at the end counts as ``unanswered``.

Measured: each legitimate request's latency (send -> whole answer) and outcome; each hostile
request's answer (the HTTP status, a gRPC code, ``closed`` / ``reset`` for a connection that
ended without a status); the gateway's RSS (psutil, every 50 ms, and the kernel's exact peak,
VmHWM, reset at each phase start); the body budget it holds and its refusal counters (its
/metrics, every 200 ms). The idle RSS (after a warm-up, no load) plus ``--body-memory-mib`` is the
bound the configuration implies; it is compared with the gateway container's memory limit in
``docker/k8s/base/gateway.yaml``.

With two or more cores the gateway gets the last core to itself and every client (legitimate in
a process of their own, hostile in this one, niced by ``--hostile-nice``) and the stub LM share
the others, so the clients' own CPU (sending 86 MiB bodies) is not the gateway's. Everything runs
on loopback. The first answer message of each kind of failure is kept (``answer_messages``).

    python bench/hostile.py --json bench/results/hostile-cpu.json --plot bench/results/hostile-cpu.png
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
from machine import pct

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.config import BODY_COPIES, GatewayConfig
from services.up import Service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "docker", "k8s", "base", "gateway.yaml")
LEGIT = ("rest", "rest-image", "grpc")
KINDS = ("rest-declared", "rest-chunked", "rest-at-limit", "rest-drip", "grpc-over", "grpc-at-limit", "grpc-stall")
DEFAULT_KINDS = KINDS[:-1]
PHASES = ("baseline", "attack", "recovery")
PROMPT = "Summarize in one sentence: the river runs past the stone bridge and the quiet market."
METHOD = "/epd.gateway.v1.GatewayService/ChatCompletion"
CHUNK = 1 << 20
DRIP_BODY = 4096
LEGIT_TIMEOUT_S = 60.0
LEGIT_MAX_OUTSTANDING = 2000
RSS_PERIOD_S, METRICS_PERIOD_S = 0.05, 0.2
MIB = 1 << 20


# -- pure helpers (tests/unit/test_bench_hostile.py) ------------------------------------------


def note(details: dict[str, str], key: str, text: str) -> str:
    """Keeps the first message seen for ``key`` (shortened); returns ``key``."""
    if key not in details:
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        details[key] = " ".join(str(text).split())[:240]
    return key


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


def manifest_memory_limit(path: str = MANIFEST) -> int | None:
    """The gateway container's memory limit in the kustomize base, in bytes (None: none set)."""
    import yaml

    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if doc and doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if c["name"] == "gateway":
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
    return out


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
        took = [e[1] - e[0] for e in es]
        out[kind] = {"clients": n, "requests": len(es), "outcomes": dict(sorted(collections.Counter(
            e[3] for e in es).items())), "median_s": round(statistics.median(took), 3) if took else None,
            "max_s": round(max(took), 3) if took else None}
    return out


# -- the gateway and what it uses ------------------------------------------------------------


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended


class Sampler:
    """The gateway's RSS every ``RSS_PERIOD_S`` and its intake metrics every ``METRICS_PERIOD_S``, on
    two threads of their own (the hostile clients' event loop must not delay them). ``mark()`` resets
    the kernel's peak (VmHWM) and returns the peak since the last mark."""

    def __init__(self, pid: int, metrics_url: str) -> None:
        self.proc, self.url = psutil.Process(pid), metrics_url
        self.rss: list[tuple[float, int, float]] = []  # (time, RSS, CPU seconds so far)
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
        while not self._stop.wait(RSS_PERIOD_S):
            try:
                rss = self.proc.memory_info().rss + sum(c.memory_info().rss for c in self.proc.children(True))
                cpu = sum(self.proc.cpu_times()[:2])
            except psutil.Error:
                return  # the gateway is gone
            self.rss.append((time.monotonic(), rss, cpu))

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
        """The peak RSS (VmHWM) since the last mark, in bytes; resets it (clear_refs 5)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                hwm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            return hwm
        except (OSError, StopIteration):
            return 0

    def window(self, t0: float, t1: float) -> dict:
        xs = [s for s in self.rss if t0 <= s[0] < t1]
        rss = [s[1] for s in xs]
        return {"rss_peak_mib": round(max(rss) / MIB, 1) if xs else None,
                "rss_steady_mib": round(statistics.median(rss) / MIB, 1) if xs else None,
                "gateway_cpu_pct": round(100 * (xs[-1][2] - xs[0][2]) / (xs[-1][0] - xs[0][0]))
                if len(xs) > 1 else None}


# -- legitimate clients (a process of their own) ---------------------------------------------


class Legit:
    """One request of each legit kind; ``call(kind)`` -> "ok" or what went wrong."""

    def __init__(self, port: int, gport: int, model: str) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
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
                async for msg in self.stub.ChatCompletion(self.grpc_req, timeout=LEGIT_TIMEOUT_S):
                    n += bool(msg.body)
                return "ok" if n else "empty"
            async with self.session.post(self.url, data=self.bodies[kind],
                                         headers={"Content-Type": "application/json"}) as r:
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


async def _legit_load(port, gport, model, tasks_per_kind, rate, start, end) -> tuple[list[tuple], dict]:
    """Open loop: every task sends on its schedule whether or not its last request has been
    answered, so a gateway that stalls shows as slow or failed requests, not as fewer of them.
    More than ``LEGIT_MAX_OUTSTANDING`` unanswered at once: the next is not sent ("not sent")."""
    legit = Legit(port, gport, model)
    samples: list[tuple] = []
    flying: set[asyncio.Task] = set()
    interval = len(LEGIT) * tasks_per_kind / rate

    async def one(kind: str) -> None:
        sent, t = time.monotonic(), time.perf_counter()
        outcome = await legit.call(kind)
        samples.append((sent, kind, time.perf_counter() - t, outcome))

    async def task(kind: str, offset: float) -> None:
        nxt = start + offset
        while nxt < end:
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            if len(flying) >= LEGIT_MAX_OUTSTANDING:
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
    """Entry of the legit clients' process: runs the load, sends the samples back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    conn.send(asyncio.run(_legit_load(*args)))  # (samples, details)
    conn.close()


# -- hostile clients (this process) ----------------------------------------------------------


class Hostile:
    """One request of each hostile kind; each returns how the gateway answered it."""

    def __init__(self, port: int, gport: int, cfg: GatewayConfig, valid: bool, model: str, drip_s: float) -> None:
        self.port, self.gport, self.max_body, self.drip_s = port, gport, cfg.max_body_bytes, drip_s
        self.timeout = cfg.body_timeout_s + 30
        self.at_limit = memoryview(at_limit_body(self.max_body, cfg, valid, model))
        self.zeros = memoryview(bytes(CHUNK))
        # Serialized once and sent as they are: the clients' CPU goes to sending, not to protobuf.
        self.grpc_at = gateway_pb2.OpenAIRequest(
            body=at_limit_body(grpc_body_len(self.max_body), cfg, valid, model)).SerializeToString()
        self.grpc_over = gateway_pb2.OpenAIRequest(body=bytes(grpc_body_len(self.max_body + 1))).SerializeToString()
        assert len(self.grpc_at) == self.max_body and len(self.grpc_over) == self.max_body + 1
        self.channels: list[grpc.aio.Channel] = []
        self.details: dict[str, str] = {}
        """The first answer's message for each (kind, outcome), as "kind outcome" -> text."""
        self.fns = {"rest-declared": self.rest_declared, "rest-chunked": self.rest_chunked,
                    "rest-at-limit": self.rest_at_limit, "rest-drip": self.rest_drip,
                    "grpc-over": lambda ch: self._grpc(ch, "grpc-over", self.grpc_over),
                    "grpc-at-limit": lambda ch: self._grpc(ch, "grpc-at-limit", self.grpc_at),
                    "grpc-stall": self.grpc_stall}

    def channel(self) -> grpc.aio.Channel:
        # A connection of its own per client (no shared subchannel): 32 streams per connection is a
        # gateway limit that must not be what throttles the attack.
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{self.gport}", options=[
            ("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)])
        self.channels.append(ch)
        return ch

    def _head(self, length: str) -> bytes:
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Content-Type: application/json\r\nConnection: close\r\n{length}\r\n\r\n").encode()

    async def _exchange(self, kind: str, head: bytes, feed) -> str:
        """Sends ``head`` then ``feed(writer)`` while waiting for the status line (and, the first time
        a kind gets a status, the message of the answer)."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as e:
            return f"connect:{type(e).__name__}"
        writer.write(head)
        sender = asyncio.ensure_future(feed(writer))
        try:
            line = await asyncio.wait_for(reader.readline(), self.timeout)
            parts = line.split()
            if len(parts) < 2 or not line.startswith(b"HTTP/"):
                return "closed"
            status = parts[1].decode()
            if f"{kind} {status}" not in self.details:
                try:
                    rest = await asyncio.wait_for(reader.read(4096), 1.0)
                except (asyncio.TimeoutError, ConnectionError, OSError):
                    rest = b""
                note(self.details, f"{kind} {status}", rest.partition(b"\r\n\r\n")[2].decode(errors="replace"))
            return status
        except asyncio.TimeoutError:
            return "no answer"
        except (ConnectionError, OSError):
            return "reset"
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.transport.abort()  # close() would wait to flush a body the gateway no longer reads

    async def _send(self, writer, data, total: int) -> None:
        sent = 0
        while sent < total:
            piece = data[sent % len(data):][:min(CHUNK, total - sent)]
            writer.write(piece)
            sent += len(piece)
            await writer.drain()

    async def rest_declared(self, _=None) -> str:
        n = self.max_body + 1
        return await self._exchange("rest-declared", self._head(f"Content-Length: {n}"),
                                    lambda w: self._send(w, self.zeros, n))

    async def rest_chunked(self, _=None) -> str:
        async def feed(w):
            frame = b"%x\r\n" % CHUNK + bytes(self.zeros) + b"\r\n"
            while True:
                w.write(frame)
                await w.drain()
        return await self._exchange("rest-chunked", self._head("Transfer-Encoding: chunked"), feed)

    async def rest_at_limit(self, _=None) -> str:
        n = len(self.at_limit)
        return await self._exchange("rest-at-limit", self._head(f"Content-Length: {n}"),
                                    lambda w: self._send(w, self.at_limit, n))

    async def rest_drip(self, _=None) -> str:
        async def feed(w):
            for _ in range(DRIP_BODY):
                w.write(b" ")
                await w.drain()
                await asyncio.sleep(self.drip_s)
        return await self._exchange("rest-drip", self._head(f"Content-Length: {DRIP_BODY}"), feed)

    async def _grpc(self, ch: grpc.aio.Channel, kind: str, message: bytes) -> str:
        call = ch.unary_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)
        try:
            async for _ in call(message, timeout=self.timeout):
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            note(self.details, f"{kind} {e.code().name}", e.details() or "")
            return e.code().name

    async def grpc_stall(self, ch: grpc.aio.Channel) -> str:
        async def never():
            await asyncio.Event().wait()
            yield gateway_pb2.OpenAIRequest()

        call = ch.stream_stream(METHOD, request_serializer=gateway_pb2.OpenAIRequest.SerializeToString,
                                response_deserializer=gateway_pb2.OpenAIResponse.FromString)
        try:
            async for _ in call(never(), timeout=self.timeout):
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            note(self.details, f"grpc-stall {e.code().name}", e.details() or "")
            return e.code().name

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


async def hostile_client(hostile: Hostile, kind: str, stop: asyncio.Event, events: list) -> None:
    """Loops ``kind`` until ``stop``; every answer goes to ``events`` as (sent, answered, kind,
    outcome); a request cut off when the run ends is ``unanswered``."""
    ch = hostile.channel() if kind.startswith("grpc") else None
    while not stop.is_set():
        t = time.monotonic()
        try:
            outcome = await hostile.fns[kind](ch)
        except asyncio.CancelledError:
            events.append((t, time.monotonic(), kind, "unanswered"))
            raise
        except Exception as e:  # noqa: BLE001 - counted, the attack goes on
            outcome = type(e).__name__
        events.append((t, time.monotonic(), kind, outcome))


# -- the run -------------------------------------------------------------------------------


async def attack(hostile: Hostile, counts: dict[str, int], t_attack: float, t_recovery: float,
                 t_end: float) -> list[tuple]:
    events: list[tuple] = []
    stop = asyncio.Event()
    await asyncio.sleep(max(0.0, t_attack - time.monotonic()))
    tasks = [asyncio.ensure_future(hostile_client(hostile, k, stop, events)) for k, n in counts.items()
             for _ in range(n)]
    await asyncio.sleep(max(0.0, t_recovery - time.monotonic()))
    stop.set()  # no new hostile requests; those in flight get until the end of the recovery phase
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, t_end - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await hostile.close()
    return events


async def warm_up(port: int, gport: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    legit = Legit(port, gport, model)
    try:
        for _ in range(20):
            for kind in LEGIT:
                if (outcome := await legit.call(kind)) != "ok":
                    raise RuntimeError(f"warm-up {kind} request failed: {outcome}")
    finally:
        await legit.close()
    return model


def run(args, cfg: GatewayConfig, flags: list[str], info: dict) -> dict:
    logdir = os.path.join(ROOT, "bench", "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    gw_cores = {cores[-1]} if args.pin and len(cores) > 1 else set(cores)
    client_cores = set(cores) - gw_cores or set(cores)
    pin(os.getpid(), client_cores)  # the stub LM and the legit process inherit it
    procs: list[Service] = []
    try:
        lm, lm_addr = start_lm(False, logdir)
        procs.append(lm)
        gw, port, gport = start_gateway(lm_addr, logdir, flags, log="hostile-bench-gateway.log")
        procs.append(gw)
        pin(gw.proc.pid, gw_cores)
        model = asyncio.run(warm_up(port, gport))
        sampler = Sampler(gw.proc.pid, f"http://127.0.0.1:{port}/metrics").start()
        time.sleep(2.0)
        idle = statistics.median(r for _, r, _ in sampler.rss[-20:])
        counts = split_clients(args.hostile, args.kinds)
        hostile = Hostile(port, gport, cfg, args.at_limit == "valid", model, args.drip_s)
        print(f"gateway pid {gw.proc.pid} on cpu {sorted(gw_cores)}, clients and stub LM on {sorted(client_cores)}; "
              f"idle RSS {idle / MIB:.0f} MiB; hostile clients {counts}", flush=True)

        t0 = time.monotonic() + 1.0
        bounds = [t0, t0 + args.phase_s, t0 + 2 * args.phase_s, t0 + 2 * args.phase_s + args.recovery_s]
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=legit_worker, name="hostile-legit", daemon=True,
                             args=(send, port, gport, model, args.legit_tasks, args.legit_rate, bounds[0], bounds[3]))
        worker.start()
        # The hostile clients yield the client cores to the legit clients and the stub LM: what the
        # legit latency shows is then the gateway's doing, not this process's 86 MiB copies.
        os.nice(args.hostile_nice)
        hwm, metrics_at = [], []

        async def phases() -> list[tuple]:
            task = asyncio.ensure_future(attack(hostile, counts, bounds[1], bounds[2], bounds[3]))
            for b in bounds:
                await asyncio.sleep(max(0.0, b - time.monotonic()))
                hwm.append(sampler.mark())
                metrics_at.append(await asyncio.to_thread(sampler.scrape))
                print(f"  t={b - t0:5.1f} s: {'phase ' + PHASES[len(hwm) - 1] if len(hwm) <= 3 else 'end'}",
                      flush=True)
            return await task

        events = asyncio.run(phases())
        if not recv.poll(LEGIT_TIMEOUT_S + 10):
            raise RuntimeError("the legit clients' process sent no samples")
        samples, legit_details = recv.recv()
        worker.join(10)
        time.sleep(1.0)
        sampler.stop()
        gateway_alive = gw.alive()
    finally:
        for p in reversed(procs):
            p.stop()
    return {"samples": samples, "events": events, "details": {"legit": legit_details, "hostile": hostile.details}, "counts": counts, "idle": idle, "bounds": bounds, "hwm": hwm[1:],
            "metrics_at": metrics_at, "sampler": sampler, "gateway_alive": gateway_alive,
            "cores": {"gateway": sorted(gw_cores), "clients": sorted(client_cores)}}


def report(res: dict, cfg: GatewayConfig, limit: int | None) -> dict:
    b, sampler = res["bounds"], res["sampler"]
    phases = []
    for i, name in enumerate(PHASES):
        phases.append({"phase": name, "t0_s": round(b[i] - b[0], 2), "t1_s": round(b[i + 1] - b[0], 2),
                       "legit": summarize_legit(res["samples"], b[i], b[i + 1]),
                       **sampler.window(b[i], b[i + 1]), "rss_hwm_mib": round(res["hwm"][i] / MIB, 1)})
        gets = [m["scrape_s"] for t, m in sampler.metrics if b[i] <= t < b[i + 1]]
        phases[-1]["metrics_get_ms"] = {"p50": round(statistics.median(gets) * 1e3, 1) if gets else None,
                                        "max": round(max(gets) * 1e3, 1) if gets else None}
    base = phases[0]["legit"].get("all", {})
    for p in phases[1:]:
        a = p["legit"].get("all", {})
        p["vs_baseline"] = {k: (round(a[k] / base[k], 2) if a.get(k) and base.get(k) else None)
                            for k in ("p50_ms", "p99_ms")}
        p["vs_baseline"]["success_delta"] = round(a.get("success", 0) - base.get("success", 0), 4)
    m0, m1 = res["metrics_at"][1], res["metrics_at"][-1]
    refused = {k.split(":", 1)[1]: int(m1.get(k, 0) - m0.get(k, 0)) for k in m1 if k.startswith("refused:")}
    held = [(t, m["held"]) for t, m in sampler.metrics if "held" in m]
    peak = max(res["hwm"])
    bound = res["idle"] + cfg.body_memory_mib * MIB
    return {
        "phases": phases,
        "hostile": summarize_hostile(res["events"], res["counts"]),
        "server_refused_during_attack_and_recovery": refused,
        "answer_messages": res["details"],
        "memory": {"idle_rss_mib": round(res["idle"] / MIB, 1), "body_memory_mib": cfg.body_memory_mib,
                   "implied_bound_mib": round(bound / MIB, 1),
                   "k8s_limit_mib": round(limit / MIB, 1) if limit else None,
                   "peak_rss_mib": round(peak / MIB, 1), "peak_under_bound": peak <= bound,
                   "peak_under_k8s_limit": None if limit is None else peak <= limit,
                   "peak_budget_held_mib": round(max((h for _, h in held), default=0) / MIB, 1),
                   "gateway_alive_at_end": res["gateway_alive"]},
        "rss_samples": [(round(t - b[0], 2), round(r / MIB, 1)) for t, r, _ in sampler.rss],
        "budget_held_samples": [(round(t - b[0], 2), round(h / MIB, 1)) for t, h in held],
        "metrics_get_ms": [(round(t - b[0], 2), round(m["scrape_s"] * 1e3, 1)) for t, m in sampler.metrics],
        "legit_samples": [(round(s[0] - b[0], 2), s[1], round(s[2] * 1e3, 1), s[3]) for s in res["samples"]],
    }


SERIES = ("rss_samples", "budget_held_samples", "metrics_get_ms", "legit_samples")
"""Time series (s since the baseline began, value): written one line each, the rest indented."""


def write_json(path: str, doc: dict) -> None:
    text = json.dumps({k: v for k, v in doc.items() if k not in SERIES}, indent=1)
    series = [f' "{k}": {json.dumps(doc[k], separators=(",", ":"))}' for k in SERIES if k in doc]
    with open(path, "w") as f:
        f.write(text[:-2] + "".join(",\n" + x for x in series) + "\n}\n")


def print_table(out: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    hdr = (f"{'phase':<10}{'legit':<12}{'n':>6}{'ok %':>8}{'p50 ms':>9}{'p99 ms':>9}{'RSS peak':>10}{'steady':>8}"
           f"{'gw cpu':>8}  failures")
    print(hdr + "\n" + "-" * len(hdr))
    for p in out["phases"]:
        for kind, s in p["legit"].items():
            fails = {k: v for k, v in s["outcomes"].items() if k != "ok"}
            rss = (fmt(p["rss_hwm_mib"]), fmt(p["rss_steady_mib"]), f"{p['gateway_cpu_pct']}%") if kind == "all" \
                else ("", "", "")
            print(f"{p['phase']:<10}{kind:<12}{s['n']:>6}{100 * s['success']:>8.1f}{fmt(s['p50_ms']):>9}"
                  f"{fmt(s['p99_ms']):>9}{rss[0]:>10}{rss[1]:>8}{rss[2]:>8}  {fails or ''}")
        g = p["metrics_get_ms"]
        print(f"{'':<10}{'GET /metrics':<12} p50 {fmt(g['p50'])} ms, max {fmt(g['max'])} ms (every 200 ms: the event loop's lag)")
        if "vs_baseline" in p:
            v = p["vs_baseline"]
            print(f"{'':<10}{'vs baseline':<12} p50 x{fmt(v['p50_ms'])}, p99 x{fmt(v['p99_ms'])}, "
                  f"success {100 * v['success_delta']:+.1f} points")
    print(f"\n{'hostile kind':<16}{'clients':>8}{'requests':>10}{'median s':>10}{'max s':>8}  answers")
    for k, h in out["hostile"].items():
        print(f"{k:<16}{h['clients']:>8}{h['requests']:>10}{fmt(h['median_s']):>10}{fmt(h['max_s']):>8}  "
              f"{h['outcomes']}")
    print(f"gateway's own refusal counters (attack + recovery): {out['server_refused_during_attack_and_recovery']}")
    for side, details in out["answer_messages"].items():
        for key, text in sorted(details.items()):
            print(f"  {side} {key}: {text[:150]}")
    m = out["memory"]
    print(f"\nmemory: idle RSS {m['idle_rss_mib']} MiB + body budget {m['body_memory_mib']:g} MiB = bound "
          f"{m['implied_bound_mib']} MiB; k8s limit {m['k8s_limit_mib']} MiB; peak RSS {m['peak_rss_mib']} MiB "
          f"(VmHWM), budget held at most {m['peak_budget_held_mib']} MiB; under bound: {m['peak_under_bound']}, "
          f"under k8s limit: {m['peak_under_k8s_limit']}; gateway alive at end: {m['gateway_alive_at_end']}")
    print("RSS peak = VmHWM of the phase (MiB); steady = median of 50 ms samples; gw cpu = the gateway's CPU time / "
          "wall time; latency = send -> whole answer, successful requests only")


def plot(out: dict, path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lx) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True, height_ratios=[3, 2])
    m = out["memory"]
    for i, p in enumerate(out["phases"]):
        for a in (ax, lx):
            a.axvspan(p["t0_s"], p["t1_s"], color=("C2", "C3", "C0")[i], alpha=0.07)
        ax.text((p["t0_s"] + p["t1_s"]) / 2, 0.98, p["phase"], transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=9)
    t, r = zip(*out["rss_samples"]) if out["rss_samples"] else ((), ())
    ax.plot(t, r, color="k", lw=1, label="gateway RSS (50 ms samples)")
    if out["budget_held_samples"]:
        t, h = zip(*out["budget_held_samples"])
        ax.plot(t, h, color="C1", lw=1, label="body budget held (its /metrics)")
    ax.axhline(m["implied_bound_mib"], color="C4", ls="--", label=f"idle RSS + --body-memory-mib = "
                                                                     f"{m['implied_bound_mib']:.0f} MiB")
    if m["k8s_limit_mib"]:
        ax.axhline(m["k8s_limit_mib"], color="red", ls=":", label=f"k8s limit {m['k8s_limit_mib']:.0f} MiB")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="center left")
    ax.grid(alpha=0.3)
    for i, kind in enumerate(LEGIT):
        ok = [(s[0], s[2]) for s in out["legit_samples"] if s[1] == kind and s[3] == "ok"]
        bad = [(s[0], s[2]) for s in out["legit_samples"] if s[1] == kind and s[3] != "ok"]
        if ok:
            lx.scatter(*zip(*ok), s=3, color=f"C{i}", label=f"{kind} ok")
        if bad:
            lx.scatter(*zip(*bad), s=14, marker="x", color=f"C{i}", label=f"{kind} failed")
    if out["metrics_get_ms"]:
        lx.plot(*zip(*out["metrics_get_ms"]), color="grey", lw=0.8, label="GET /metrics (event-loop lag)")
    lx.set_yscale("log")
    lx.set_ylabel("legit latency (ms)")
    lx.set_xlabel("s since the baseline began")
    lx.legend(fontsize=7, ncol=2, loc="upper left")
    lx.grid(alpha=0.3, which="both")
    fig.suptitle(f"epd-serve gateway under hostile clients; {info['cpu']} ({info['cores']} cores), "
                 f"{info['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hostile", type=int, default=64, help="hostile clients, split evenly over --kinds")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    ap.add_argument("--at-limit", choices=("valid", "invalid"), default="valid",
                    help="at-limit bodies: a valid chat request with two largest images, or invalid JSON")
    ap.add_argument("--phase-s", type=float, default=0, help="baseline and attack length (default 15, --quick 4)")
    ap.add_argument("--recovery-s", type=float, default=0,
                    help="recovery length (default --body-timeout-s + 5, --quick 4)")
    ap.add_argument("--legit-rate", type=float, default=60.0, help="legitimate requests per second, all kinds")
    ap.add_argument("--legit-tasks", type=int, default=2, help="client tasks per legit kind")
    ap.add_argument("--drip-s", type=float, default=0.1, help="seconds between the bytes of a slow upload")
    for flag in ("body-memory-mib", "max-body-readers", "body-timeout-s"):
        ap.add_argument(f"--{flag}", type=float if flag != "max-body-readers" else int, default=None,
                        help="passed to the gateway (default: the gateway's own)")
    ap.add_argument("--hostile-nice", type=int, default=10, help="niceness of the hostile clients' process")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not give the gateway a core of its own")
    ap.add_argument("--quick", action="store_true", help="4 s phases")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG plot here")
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or any(k not in KINDS for k in args.kinds):
        ap.error(f"--kinds must name some of {', '.join(KINDS)}")
    given = {f: getattr(args, f) for f in ("body_memory_mib", "max_body_readers", "body_timeout_s")
             if getattr(args, f) is not None}
    cfg = GatewayConfig(lms="127.0.0.1:1", **given)
    flags = [x for f, v in given.items() for x in (f"--{f.replace('_', '-')}", str(v))]
    args.phase_s = args.phase_s or (4.0 if args.quick else 15.0)
    args.recovery_s = args.recovery_s or (4.0 if args.quick else cfg.body_timeout_s + 5)
    limit = manifest_memory_limit()
    info = machine(["python", os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0],
                    *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"max_body_bytes {cfg.max_body_bytes} ({cfg.max_body_bytes / MIB:.1f} MiB), body budget "
          f"{cfg.body_memory_mib:g} MiB ({BODY_COPIES} x each body), {cfg.max_body_readers} readers, body timeout "
          f"{cfg.body_timeout_s:g} s; phases {args.phase_s:g} / {args.phase_s:g} / {args.recovery_s:g} s", flush=True)
    t = time.monotonic()
    res = run(args, cfg, flags, info)
    info["measure_s"] = round(time.monotonic() - t, 1)
    info["cores_used"] = res["cores"]
    out = report(res, cfg, limit)
    print_table(out)
    setup = {"hostile": args.hostile, "kinds": args.kinds, "clients": res["counts"], "at_limit": args.at_limit,
             "phase_s": args.phase_s, "recovery_s": args.recovery_s, "legit_rate": args.legit_rate,
             "legit_tasks_per_kind": args.legit_tasks, "drip_s": args.drip_s, "hostile_nice": args.hostile_nice, "gateway_flags": flags,
             "max_body_bytes": cfg.max_body_bytes, "body_memory_mib": cfg.body_memory_mib,
             "max_body_readers": cfg.max_body_readers, "body_timeout_s": cfg.body_timeout_s,
             "body_copies": BODY_COPIES, "k8s_manifest": os.path.relpath(MANIFEST, ROOT)}
    if args.json:
        write_json(args.json, {"machine": info, "setup": setup, **out})
    if args.plot:
        plot(out, args.plot, info)
    return 0 if res["gateway_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
