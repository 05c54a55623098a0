"""Serving benchmark: the seed's mixed workload on four systems with the same cores.

Workload: Poisson arrivals at a fixed rate; a fraction of the requests
(``--image-fractions``, default 0.1: every 10th) carries a large image, the
rest are text. Every request streams, and the client measures TTFT, TPOT (mean
inter-token time after the first token) and ITL per request. Systems, on the
same cores (``--cores``, default: all of this machine):

* ``colocated``: one vLLM engine (our LM service without encoders: it encodes
  images itself, as plain vLLM does) on all cores, behind the gateway;
* ``colocated-dp2``: two such LM services, each on half the cores, behind the
  same gateway (``--lms a,b``; it routes to the least-outstanding LM): data
  parallel on equal cores;
* ``epd``: our encoder on half the cores, our LM on the other half (1E1PD),
  same gateway;
* ``epd-pd``: E -> P -> D: our encoder on half the cores, a prefill LM and a decode LM
  (``--role prefill|decode``, vLLM's NixlConnector between them) on the other half (on 2 cores the
  prefill LM shares the encoder's core), same gateway;
* ``vllm-epd``: vLLM's own E -> P -> D (upstream's ``disagg_1e1p1d_example.sh``): an
  ``ec_producer`` server, an ``ec_consumer`` + ``kv_producer`` prefill server and a ``kv_consumer``
  decode server (NixlConnector with our LM's settings) on the same cores as ``epd-pd``, behind
  ``bench/ec_proxy.py --prefill`` (encode, then prefill with ``max_tokens`` 1, then decode with the
  prefill's ``kv_transfer_params``, as upstream's ``disagg_epd_proxy.py``);
* ``vllm-ec``: vLLM's own encoder disaggregation, ``ECExampleConnector``
  (files): an ``ec_producer`` vLLM OpenAI server on half the cores, an
  ``ec_consumer`` one on the other half, and ``bench/ec_proxy.py`` in front,
  which drives them sequentially as upstream's example proxy does. Same engine
  settings as our services (``services.common.engine.EngineConfig`` defaults).
* ``vllm-mooncake``: vLLM's ``ECMooncakeConnector`` as vLLM's guide sets it up for 1E + 1PD: an
  ``ec_producer`` server on half the cores, an ``ec_consumer`` one (``--enable-mm-embeds``, its Mooncake
  control address ``ec_ip``/``ec_port``) on the other half, Mooncake's transfer engine over TCP
  (``MC_FORCE_TCP=1``, buffers in host memory), behind ``bench/mooncake_proxy.py`` (upstream proxy's
  choreography: encode with transfer ids and the consumer's address, then the request to the consumer
  naming them). Needs ``make bench-mooncake-install`` (``mooncake-transfer-engine-non-cuda``). On CPU
  (vLLM's V1 model runner) the consumer loads a push only in a step that has tokens to run: an image
  request that finds it idle waits for ``push_wait_timeout_s`` (docs/benchmarks.md).
* ``epd-nixl``: ``epd`` with ``--transports nixl`` on the encoder and the LM.

For the gateway systems the benchmark reads the gateway's
``epd_gateway_stage_seconds`` histograms before and after each run and reports
the mean of every stage. ``--cost-ratio`` instead measures what one image costs
in decode steps (sequential requests, no load) for each ``--variants`` model.

The models are the ``bench-light`` variant of the built-in model (its image
costs about as many decode steps as a 7B VLM's image on a GPU) unless
``--variant`` or ``--model`` says otherwise.

    python bench/serving.py --quick --rates 0.5,1.5 --json bench/results/serving-cpu-light.json --plot ...
    python bench/serving.py --cost-ratio --variants bench,bench-light --json bench/results/serving-cpu-cost.json
    python bench/serving.py --device cuda --model /models/Qwen2.5-VL-3B-Instruct \
        --vllm-args '{"enforce_eager": false, "max_num_seqs": 64}' --rates 2,8 --json bench/results/serving-h100.json

With ``--device cuda`` the systems share one GPU instead of splitting cores: each engine gets a
slice of its memory (``GPU_SHARES``; colocated 0.85, two replicas 0.42 each, encoder 0.2 + LM
0.65), vLLM sizes each KV cache from its slice, and the engines start one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/machine.py, also when imported by path

import aiohttp
from machine import machine_info, pct

from ectransfer.shm import cleanup_orphans
from services.common.engine import SERVICE_ENV, EngineConfig
from services.probe import http_ok
from services.up import Service, free_port, grpc_serving, wait_ready
from tools.media import data_url, make_image

WORDS = ("the river light stone cloud north window garden silver market evening paper quiet "
         "engine summer letter mountain bridge winter forest harbor lantern orchard").split()
SYSTEMS = ("colocated", "colocated-dp2", "epd", "epd-wait", "epd-seq", "epd-mp", "epd-auto", "vllm-ec", "epd-pd", "vllm-epd",
           "vllm-mooncake", "epd-nixl")
STAGES = ("queue", "metadata", "encode", "transfer", "lm_queue", "ttft", "tpot", "total")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def workload(n: int, rate: float, image_fraction: Fraction, prompt_words: int, image_size, seed: int = 0):
    """Request i carries an image when floor((i+1)*f) > floor(i*f): evenly spread, and for f = 1/k
    exactly every k-th request (the seed's "every 10th" at f = 0.1)."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        text = "Summarize: " + " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        content: list | str = text
        if int((i + 1) * image_fraction) > int(i * image_fraction):
            url = data_url(make_image(seed * 100_000 + i, image_size))
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        reqs.append((t, {"messages": [{"role": "user", "content": content}], "stream": True}))
    return reqs


async def one(session, url: str, body: dict, max_tokens: int, t_send: float) -> dict:
    # return_token_ids: vLLM's own server (vllm-ec) then puts token_ids in every chunk, as the gateway does.
    body = dict(body, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True)
    arrivals, n, error = [], 0, ""
    image = isinstance(body["messages"][0]["content"], list)
    try:
        async with session.post(url, json=body) as resp:
            status = resp.status
            if status != 200:  # refused before streaming: the body is the error
                error = (await resp.text())[:300]
            else:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # failed after the stream started
                        status = chunk["error"].get("code", 500)
                        error = str(chunk["error"].get("message", ""))[:300]
                        continue
                    for c in chunk.get("choices", []):
                        k = len(c.get("token_ids") or [])
                        if k:
                            arrivals.append((time.perf_counter(), k))
                            n += k
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the connection broke or timed out
        status, error = 0, repr(e)[:300]
    if status != 200 or not arrivals:
        # Every failure is recorded with its status and message: a refusal at admission (429/503)
        # is load shed, anything after the stream started is a failure of an admitted request.
        return {"ok": False, "image": image, "status": status, "error": error or "no tokens",
                "started": bool(arrivals)}
    ttft = arrivals[0][0] - t_send
    itls = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
    e2e = arrivals[-1][0] - t_send
    tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
    return {"ok": True, "image": image, "ttft": ttft, "tpot": tpot, "itls": itls, "e2e": e2e, "tokens": n}


async def drive(url: str, reqs, max_tokens: int) -> tuple[list[dict], float]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def at(offset, body):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one(session, url, body, max_tokens, time.perf_counter())

        results = await asyncio.gather(*(at(off, body) for off, body in reqs))
        return results, time.perf_counter() - t0


# ----------------------------------------------------------------------------- systems


@dataclass(eq=False)
class Command(Service):
    """A process that is not an ``epd`` service (a vLLM OpenAI server, the proxy): a ``Service``
    with a whole ``command`` (started in its own session, stopped like a service: SIGTERM, then the
    group) and ``extra_env`` on top of the environment it is started with."""

    extra_env: dict | None = None

    def start(self, env: dict[str, str] | None = None) -> Command:
        return super().start({**(env or os.environ), **(self.extra_env or {})})


def _fmt(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def _halves(cores: list[int]) -> tuple[list[int], list[int]]:
    half = max(1, len(cores) // 2)
    return cores[:half], cores[half:] or cores


# --device cuda: every engine of a system shares one GPU, so each gets a slice of its memory
# (vLLM's gpu_memory_utilization) instead of cores; an encoder-only engine holds weights and its
# encoder cache but no KV cache. Each system's slices sum to 0.85.
GPU_SHARES = {"colocated": {"lm": 0.85}, "colocated-dp2": {"lm0": 0.42, "lm1": 0.42},
              "epd": {"encoder": 0.2, "lm": 0.65}, "epd-wait": {"encoder": 0.2, "lm": 0.65},
              "epd-seq": {"encoder": 0.2, "lm": 0.65}, "epd-mp": {"encoder": 0.2, "lm": 0.65},
              "epd-auto": {"encoder": 0.2, "lm": 0.65}, "epd-nixl": {"encoder": 0.2, "lm": 0.65},
              "vllm-ec": {"producer": 0.2, "consumer": 0.65}, "vllm-mooncake": {"producer": 0.2, "consumer": 0.65},
              "epd-pd": {"encoder": 0.15, "prefill": 0.35, "decode": 0.35},
              "vllm-epd": {"producer": 0.15, "prefill": 0.35, "decode": 0.35}}

# E -> P -> D (epd-pd, vllm-epd): vLLM's NixlConnector between the prefill and the decode engine, with
# the settings our LM service gives it (services.lm.server.kv_transfer_config): KV staged in host memory
# on CPU, the same lease.
KV_LEASE_S = 120


def engine_args_for(name: str, tag: str, device: str, vllm_args: dict) -> dict:
    """``--vllm-args`` of one engine: on cuda its memory slice (the caller's own values win)."""
    if device != "cuda":
        return dict(vllm_args)
    return {"gpu_memory_utilization": GPU_SHARES[name][tag], **vllm_args}


def nixl_config(role: str, device: str) -> dict:
    """vLLM's ``--kv-transfer-config`` for a prefill (``kv_producer``) or decode (``kv_consumer``) server."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu" if device == "cpu" else "cuda",
            "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}}


def vllm_server_argv(model: str, port: int, vllm_args: dict, ec: dict | None, device: str = "cpu",
                     kv: dict | None = None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with the engine settings our services use
    (``EngineConfig`` defaults, plus ``--vllm-args``): the comparison differs only in the system.
    On cuda the KV cache is sized by vLLM from the engine's memory slice, as for our services."""
    cfg = EngineConfig(model=model)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
            "--max-num-seqs", str(cfg.max_num_seqs), "--seed", str(cfg.seed),
            "--limit-mm-per-prompt", json.dumps({"image": cfg.max_images_per_prompt}),
            "--disable-uvicorn-access-log"]
    if ec is not None:
        argv += ["--ec-transfer-config", json.dumps(ec)]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    if device != "cuda":
        argv += ["--kv-cache-memory-bytes", str(cfg.kv_cache_bytes)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    for k, v in vllm_args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False:
            argv.append("--no-" + k.replace("_", "-"))
        else:
            argv += [flag, v if isinstance(v, str) else json.dumps(v)]
    return argv


# The environment the services run vLLM under (services.common.engine), for the vLLM servers of ``vllm-ec``.
VLLM_ENV = dict(SERVICE_ENV)

# vllm-mooncake: each side's registered buffer (ec_buffer_size; vLLM's default is 1e9). The consumer's
# holds every reserved, not yet consumed encoder output (an image of the bench models is under 1 MiB).
MOONCAKE_BUFFER_BYTES = 256 << 20
# vllm-mooncake's proxy: upstream's --no-rewrite (the consumer gets the images as sent, with their transfer
# ids). Upstream's default rewrites each image to metadata-only embeds, but only for a model whose parser
# declares placeholder metadata (Qwen-VL's image_grid_thw); the bench models (Idefics3) declare none, so
# that path sends the image without its uuid and without naming its transfer, and the consumer waits for
# a push under its own hash of the image until push_wait_timeout_s (60 s) fails the request (measured).
MOONCAKE_REWRITE = False
# Where `make bench-mooncake` unpacks Debian's libibverbs1 (and libnl) when it cannot install them as
# root: the transfer engine's extension links libibverbs.so.1 even for TCP.
MOONCAKE_LIBS = os.environ.get("EPD_MOONCAKE_LIBS", os.path.join(os.path.dirname(BENCH_DIR), ".venv", "mooncake-libs"))


def mooncake_ec_configs(device: str, control_port: int) -> tuple[dict, dict]:
    """``--ec-transfer-config`` of the producer and the consumer of ``vllm-mooncake``, as vLLM's
    ECMooncakeConnector guide writes them for 1E + 1PD, over TCP (the guide's no-RDMA path): the
    consumer listens for reservations on ``ec_ip``:``ec_port``, the proxy names that address to the
    producer. On CPU both buffers are host memory (``ec_buffer_device`` "cpu")."""
    common = {"ec_connector": "ECMooncakeConnector", "ec_buffer_size": MOONCAKE_BUFFER_BYTES,
              "ec_buffer_device": "cpu" if device == "cpu" else "cuda",
              "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}
    return ({**common, "ec_role": "ec_producer"},
            {**common, "ec_role": "ec_consumer", "ec_ip": "127.0.0.1", "ec_port": control_port})


def mooncake_env(libs: str = MOONCAKE_LIBS) -> dict[str, str]:
    """The environment of a ``vllm-mooncake`` server: TCP forced (the guide's TCP path: the engine could
    pick RDMA where a device exists) and, where the libraries were unpacked without root, their folder
    first on the library path."""
    env = {"MC_FORCE_TCP": "1"}
    dirs = sorted(d for d in (os.path.join(libs, sub) for sub in ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
                                                                 "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"))
                  if os.path.isdir(d))
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    return env


class System:
    """One system's processes on the given cores; ``start()`` waits until it answers, ``stop()``
    stops every process group it started (also after a failed start)."""

    def __init__(self, name: str, model: str, cores: list[int], logdir: str, vllm_args: str,
                 device: str = "cpu") -> None:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        self.name, self.model, self.device = name, model, device
        self.port = free_port()
        self.engines: list[tuple[Service, object]] = []  # (process, readiness check)
        self.tmpdir = ""
        log = lambda role: os.path.join(logdir, f"{name}-{role}.log")  # noqa: E731
        base_args = json.loads(vllm_args)

        def epd_service(role: str, tag: str, cs: list[int], extra: list[str] = ()) -> str:
            port = free_port()
            # CPU: disjoint cores per engine. cuda: one GPU, a memory slice per engine, KV sized by vLLM.
            placement = (["--cpu-cores", _fmt(cs)] if device == "cpu" else ["--kv-cache-bytes", "0"])
            svc = Service(role, [role, "--port", str(port), *placement, "--metrics-port", str(free_port()),
                                 "--model", model, *extra, "--vllm-args",
                                 json.dumps(engine_args_for(name, tag, device, base_args))], log(tag))
            addr = f"127.0.0.1:{port}"
            self.engines.append((svc, (lambda a: lambda: grpc_serving(a))(addr)))
            return addr

        a, b = _halves(cores)
        # E -> P -> D: the encoder on the first half; the prefill and decode engines split the second
        # (on 2 cores the decode engine keeps its core and the prefill engine shares the encoder's, as
        # `epd up --prefills 1 --decodes 1` places them).
        p_cores, d_cores = (_halves(b) if len(b) > 1 else (a, b))
        if name == "vllm-epd":
            self.tmpdir = tempfile.mkdtemp(prefix="vllm-epd-")
            storage = {"shared_storage_path": self.tmpdir}
            urls = []
            for role, cs, ec, kv in (
                    ("producer", a, {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                                     "ec_connector_extra_config": storage}, None),
                    ("prefill", p_cores, {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                                          "ec_connector_extra_config": storage}, nixl_config("kv_producer", device)),
                    ("decode", d_cores, None, nixl_config("kv_consumer", device))):  # as upstream's 1e1p1d
                port = free_port()
                env = {**VLLM_ENV, **({"VLLM_CPU_OMP_THREADS_BIND": _fmt(cs)} if device == "cpu" else {})}
                if kv is not None:
                    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
                svc = Command(role, [], log(role), extra_env=env, command=vllm_server_argv(
                    model, port, engine_args_for(name, role, device, base_args), ec, device, kv))
                url = f"http://127.0.0.1:{port}"
                self.engines.append((svc, (lambda u: lambda: http_ok(u + "/health"))(url)))
                urls.append(url)
            self.front = Command("proxy", [], log("proxy"), command=[
                sys.executable, os.path.join(BENCH_DIR, "ec_proxy.py"), "--port", str(self.port),
                "--producer", urls[0], "--prefill", urls[1], "--consumer", urls[2], "--model", model])
            return
        if name == "vllm-ec":
            self.tmpdir = tempfile.mkdtemp(prefix="vllm-ec-")
            urls = []
            for role, cs in (("producer", a), ("consumer", b)):
                port = free_port()
                ec = {"ec_connector": "ECExampleConnector", "ec_role": f"ec_{role}",
                      "ec_connector_extra_config": {"shared_storage_path": self.tmpdir}}
                env = {**VLLM_ENV, **({"VLLM_CPU_OMP_THREADS_BIND": _fmt(cs)} if device == "cpu" else {})}
                svc = Command(role, [], log(role), extra_env=env, command=vllm_server_argv(
                    model, port, engine_args_for(name, role, device, base_args), ec, device))
                url = f"http://127.0.0.1:{port}"
                self.engines.append((svc, (lambda u: lambda: http_ok(u + "/health"))(url)))
                urls.append(url)
            self.front = Command("proxy", [], log("proxy"), command=[
                sys.executable, os.path.join(BENCH_DIR, "ec_proxy.py"), "--port", str(self.port),
                "--producer", urls[0], "--consumer", urls[1], "--model", model])
            return
        if name == "vllm-mooncake":
            control = free_port()
            urls = []
            for role, cs, ec, extra in zip(("producer", "consumer"), (a, b), mooncake_ec_configs(device, control),
                                           ([], ["--enable-mm-embeds"])):
                port = free_port()
                env = {**VLLM_ENV, **mooncake_env(),
                       **({"VLLM_CPU_OMP_THREADS_BIND": _fmt(cs)} if device == "cpu" else {})}
                svc = Command(role, [], log(role), extra_env=env, command=[*vllm_server_argv(
                    model, port, engine_args_for(name, role, device, base_args), ec, device),
                    "--enable-request-id-headers", *extra])
                url = f"http://127.0.0.1:{port}"
                self.engines.append((svc, (lambda u: lambda: http_ok(u + "/health"))(url)))
                urls.append(url)
            self.front = Command("proxy", [], log("proxy"), command=[
                sys.executable, os.path.join(BENCH_DIR, "mooncake_proxy.py"), "--port", str(self.port),
                "--encoder", urls[0], "--consumer", urls[1], "--consumer-zmq", f"tcp://127.0.0.1:{control}",
                "--model", model, *([] if MOONCAKE_REWRITE else ["--no-rewrite"])])
            return
        if name == "colocated":
            lms, encoders = [epd_service("lm", "lm", cores)], []
        elif name == "colocated-dp2":
            lms, encoders = [epd_service("lm", "lm0", a), epd_service("lm", "lm1", b)], []
        elif name == "epd-pd":
            encoders = [epd_service("encoder", "encoder", a)]
            lms = [epd_service("lm", role, cs, ["--role", role, "--kv-host", "127.0.0.1", "--kv-port", str(free_port())])
                   for role, cs in (("prefill", p_cores), ("decode", d_cores))]
        else:  # epd, epd-auto (the gateway's --placement auto), epd-wait (the LM waits for every item), epd-seq
            # (the gateway's --dispatch sequential: the LM gets a request once its items are encoded), epd-mp
            # (both engines with vLLM's CPU default executor: a worker process beside each EngineCore), epd-nixl
            # (the NIXL transport forced on both ends)
            mp = ["--executor", "mp"] if name == "epd-mp" else []
            mp += ["--transports", "nixl"] if name == "epd-nixl" else []
            wait = ["--no-connector-prefill-in-step"] if name == "epd-wait" else []
            encoders, lms = [epd_service("encoder", "encoder", a, mp)], [epd_service("lm", "lm", b, wait + mp)]
        self.front = Service("gateway", ["gateway", "--epd-facts", "--port", str(self.port), "--lms", ",".join(lms),
                                         "--encoders", ",".join(encoders),
                                         "--placement", "auto" if name == "epd-auto" else "encoder",
                                         *(["--dispatch", "sequential"] if name == "epd-seq" else [])], log("gateway"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def start(self, timeout: float = 600.0) -> System:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # On one GPU the engines start one after another: vLLM sizes its KV cache from the
        # memory it sees free, which an engine still loading next to it would distort.
        waves = [[e] for e in self.engines] if self.device == "cuda" else [self.engines]
        try:
            deadline = time.monotonic() + timeout
            for wave in waves:
                for svc, _ in wave:
                    svc.start(env)
                wait_ready(dict(wave), deadline)
            self.front.start(env)
            wait_ready({self.front: lambda: http_ok(f"http://127.0.0.1:{self.port}/health")}, deadline, poll_s=0.2)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {e}") from None  # start_system retries on this
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in [self.front, *reversed([s for s, _ in self.engines])]:
            s.stop()
        cleanup_orphans()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative CPU seconds (user + system, every thread) per process of this system, named
        by role: the front (``gateway``, ``proxy``), each service (``encoder``, ``lm``, ``lm0``, ...)
        and, as ``<role> engine``, everything it started (vLLM's EngineCore and its workers).
        Differences over a run, divided by its requests, say which process a request costs most."""
        import psutil

        out: dict[str, float] = {}
        for svc in [self.front, *(s for s, _ in self.engines)]:
            if svc.proc is None:
                continue
            role = os.path.basename(svc.log_path)[len(self.name) + 1:-len(".log")] or svc.name
            try:
                proc = psutil.Process(svc.proc.pid)
                t = proc.cpu_times()
                out[role] = t.user + t.system
                kids = 0.0
                for child in proc.children(recursive=True):
                    try:
                        c = child.cpu_times()
                        kids += c.user + c.system
                    except psutil.Error:  # exited between the listing and the read
                        pass
                if kids:
                    out[f"{role} engine"] = kids
            except psutil.Error:
                pass
        return out

    def stage_totals(self) -> dict:
        """Cumulative per-stage (sum seconds, count): the gateway's histograms, or for ``vllm-ec`` and
        ``vllm-epd`` the proxy's producer round trips (its "encode" stage) and prefill round trips."""
        base = f"http://127.0.0.1:{self.port}"
        if self.name in ("vllm-ec", "vllm-epd", "vllm-mooncake"):
            with urllib.request.urlopen(base + "/stats", timeout=5) as r:
                s = json.load(r)
            return {stage: (s[f"{stage}_s_sum"], s[f"{stage}_count"]) for stage in ("encode", "prefill")
                    if s.get(f"{stage}_count")}
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, list[float]] = {}
        for m in re.finditer(r'^epd_gateway_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M):
            out.setdefault(m.group(2), [0.0, 0.0])[m.group(1) == "count"] = float(m.group(3))
        return {k: (v[0], v[1]) for k, v in out.items()}


def start_system(name: str, model: str, cores: list[int], logdir: str, vllm_args: str, tries: int = 3,
                 device: str = "cpu") -> System:
    """Start a system, with fresh ports on a failed try: a port that ``free_port`` found free can be
    taken by another process before the service binds it."""
    for i in range(tries):
        try:
            return System(name, model, cores, logdir, vllm_args, device).start()
        except RuntimeError as e:
            if i == tries - 1:
                raise
            print(f"{name}: start failed, retrying with new ports ({str(e).splitlines()[0]})", flush=True)
    raise AssertionError


def stage_means(before: dict, after: dict) -> dict:
    """Mean ms per stage over one run (only stages that saw requests)."""
    out = {}
    for stage in STAGES:
        s0, c0 = before.get(stage, (0.0, 0.0))
        s1, c1 = after.get(stage, (0.0, 0.0))
        if c1 > c0:
            out[stage] = {"mean_ms": round((s1 - s0) / (c1 - c0) * 1e3, 1), "count": int(c1 - c0)}
    return out


# ----------------------------------------------------------------------------- results



def summarize(system: str, rate: float, fraction: Fraction, results: list[dict], duration: float,
              stages: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    text = [r for r in ok if not r["image"]]
    image = [r for r in ok if r["image"]]
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731

    def dist(vals):
        if not vals:
            return {"mean": None, "median": None, "p99": None}
        return {"mean": ms(statistics.mean(vals)), "median": ms(statistics.median(vals)), "p99": ms(pct(vals, 0.99))}

    stats = lambda rs, key: dist([r[key] for r in rs])  # noqa: E731
    itls = [x for r in ok for x in r["itls"]]
    return {
        "system": system, "rate": rate, "image_fraction": float(fraction), "requests": len(results),
        "image_requests": sum(r["image"] for r in results), "failed": len(results) - len(ok),
        "failures": _failures([r for r in results if not r["ok"]]),
        "duration_s": round(duration, 2), "req_per_s": round(len(ok) / duration, 3),
        "out_tok_per_s": round(sum(r["tokens"] for r in ok) / duration, 1),
        "ttft_ms": stats(ok, "ttft"), "tpot_ms": stats(ok, "tpot"),
        "itl_ms": dist(itls),
        "text_tpot_ms": stats(text, "tpot"), "text_ttft_ms": stats(text, "ttft"),
        "image_ttft_ms": stats(image, "ttft"), "image_tpot_ms": stats(image, "tpot"),
        "stages_ms": stages,
        "raw": {"text_tpot": [r["tpot"] for r in text], "tpot": [r["tpot"] for r in ok],
                "ttft": [r["ttft"] for r in ok], "text_ttft": [r["ttft"] for r in text],
                "image_ttft": [r["ttft"] for r in image]},
    }


def _failures(failed: list[dict]) -> dict:
    """Failed requests by status (0: connection broken or timed out), with a few messages, and how
    many failed after their first token (admitted requests that broke half-way)."""
    by: dict[str, dict] = {}
    for r in failed:
        entry = by.setdefault(str(r["status"]), {"count": 0, "messages": []})
        entry["count"] += 1
        if r["error"] not in entry["messages"] and len(entry["messages"]) < 3:
            entry["messages"].append(r["error"])
    return {"by_status": by, "after_first_token": sum(r["started"] for r in failed)}


def print_table(rows: list[dict]) -> None:
    s = lambda v: "-" if v is None else str(v)  # noqa: E731
    hdr = (f"{'system':<14}{'rate':>5}{'img%':>5}{'req/s':>7}{'tok/s':>7}{'TTFT50':>8}{'TTFT99':>8}"
           f"{'TPOT50':>8}{'TPOT99':>8}{'txtTPOT50':>10}{'txtTPOT99':>10}{'txtTTFT50':>10}{'imgTTFT50':>10}"
           f"{'fail':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['system']:<14}{r['rate']:>5}{round(r['image_fraction'] * 100):>5}{r['req_per_s']:>7}"
              f"{r['out_tok_per_s']:>7}{s(r['ttft_ms']['median']):>8}{s(r['ttft_ms']['p99']):>8}"
              f"{s(r['tpot_ms']['median']):>8}{s(r['tpot_ms']['p99']):>8}{s(r['text_tpot_ms']['median']):>10}"
              f"{s(r['text_tpot_ms']['p99']):>10}{s(r['text_ttft_ms']['median']):>10}"
              f"{s(r['image_ttft_ms']['median']):>10}{r['failed']:>5}")
    print("times in ms; TPOT = mean inter-token time after the first token; txt*/img* = text-only/image requests")
    for r in rows:
        for status, entry in (r.get("failures") or {}).get("by_status", {}).items():
            print(f"  {r['system']} @ {r['rate']}: {entry['count']} x status {status}: {entry['messages'][0]}")
    print("\nmean per stage (ms; gateway histograms; vllm-ec: the proxy's producer round trip as encode)")
    print(f"{'system':<14}{'rate':>5}{'img%':>5}" + "".join(f"{st:>10}" for st in STAGES))
    for r in rows:
        print(f"{r['system']:<14}{r['rate']:>5}{round(r['image_fraction'] * 100):>5}" +
              "".join(f"{s(r['stages_ms'].get(st, {}).get('mean_ms')):>10}" for st in STAGES))


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(max(14, 1.6 * len(rows) + 4), 5))
    labels = [f"{r['system']}\n{r['rate']}/s {round(r['image_fraction'] * 100)}%img" for r in rows]
    panels = (("ttft", "TTFT, all requests (ms, log)"), ("tpot", "TPOT, all requests (ms)"),
              ("text_tpot", "TPOT, text-only requests (ms)"))
    for ax, (key, name) in zip(axes, panels):
        ax.boxplot([[x * 1e3 for x in r["raw"][key]] or [float("nan")] for r in rows], tick_labels=labels)
        ax.set_title(name)
    axes[0].set_yscale("log")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- cost ratio


async def _sequential(url: str, bodies: list[dict], max_tokens: int) -> list[dict]:
    """Non-streaming requests one at a time; the gateway's ``epd.timings`` of each."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for body in bodies:
            body = dict(body, stream=False, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            async with session.post(url, json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"request failed: {r.status} {data}")
                out.append(data["epd"]["timings"])
    return out


def cost_ratio(variant: str, model: str, cores: list[int], logdir: str, vllm_args: str, size, words: int,
               max_tokens: int, k: int = 12, device: str = "cpu") -> dict:
    """What one image costs in decode steps, with no load: on ``epd`` (encoder and LM on one core
    each) the encoder's encode_ms (image decode + preprocessing + vision tower) over the LM's TPOT of
    a text request; on ``colocated`` (all cores) the extra TTFT of an image request over a text one
    (encode + prefill of its image tokens), over TPOT. Image and text requests alternate, so a drift
    in the machine's speed hits both alike; medians of ``k`` each."""
    out = {"variant": variant, "model": model, "pairs": k}
    imgs = [b for _, b in workload(k + 2, 1.0, Fraction(1), words, size, seed=7)]
    texts = [b for _, b in workload(k + 2, 1.0, Fraction(0), words, size, seed=8)]
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    for name in ("epd", "colocated"):
        system = start_system(name, model, cores, logdir, vllm_args, device=device)
        try:
            asyncio.run(_sequential(system.url, [imgs[0], texts[0], imgs[1], texts[1]], 8))  # warm-up
            both = asyncio.run(_sequential(system.url, [b for pair in zip(imgs[2:], texts[2:]) for b in pair],
                                           max_tokens))
        finally:
            system.stop()
        ti, tt = both[0::2], both[1::2]
        tpot = med([t["tpot_ms"] for t in tt])
        raw = {"image": ti, "text": tt}
        if name == "epd":
            enc = med([t["encode_ms"] for t in ti])
            out["epd"] = {"encode_ms": enc, "text_tpot_ms": tpot, "steps_per_image": round(enc / tpot, 1),
                          "image_ttft_ms": med([t["ttft_ms"] for t in ti]),
                          "text_ttft_ms": med([t["ttft_ms"] for t in tt]), "raw": raw}
        else:
            extra = med([t["ttft_ms"] for t in ti]) - med([t["ttft_ms"] for t in tt])
            out["colocated"] = {"image_ttft_ms": med([t["ttft_ms"] for t in ti]),
                                "text_ttft_ms": med([t["ttft_ms"] for t in tt]), "text_tpot_ms": tpot,
                                "image_extra_ttft_ms": round(extra, 1), "steps_per_image": round(extra / tpot, 1),
                                "raw": raw}
        print(f"{variant} {name}: " + str({k2: v for k2, v in out[name].items() if k2 != "raw"}), flush=True)
    return out


# ----------------------------------------------------------------------------- main


def parse_cores(spec: str) -> list[int]:
    if not spec:
        return sorted(os.sched_getaffinity(0))
    a, _, b = spec.partition("-")
    return list(range(int(a), int(b or a) + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir or name (default: the built-in --variant)")
    ap.add_argument("--variant", default="bench-light", help="built-in model variant when --model is not given")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--rates", default="0.5,1.5", help="requests per second, comma-separated")
    ap.add_argument("--image-fractions", default="",
                    help="fractions of requests that carry an image, comma-separated, e.g. 0,0.1,0.5,1 "
                         "(every rate runs every fraction; default: 1/--image-every)")
    ap.add_argument("--image-every", type=int, default=10, help="every n-th request carries an image (0: none)")
    ap.add_argument("--requests", type=int, default=80, help="requests per run")
    ap.add_argument("--image-size", default="768x512")
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cores", default="", help="cores every system uses, e.g. 0-7 (default: all)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: engines split --cores; cuda: every engine of a system shares one GPU, each with a "
                         "slice of its memory (GPU_SHARES), started one after another")
    ap.add_argument("--vllm-args", default="{}")
    ap.add_argument("--quick", action="store_true", help="40 requests per run")
    ap.add_argument("--cost-ratio", action="store_true",
                    help="measure encode time per image vs decode step for each --variants model, then exit")
    ap.add_argument("--variants", default="bench,bench-light", help="variants for --cost-ratio")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()

    from services.cli import default_model

    cores = parse_cores(args.cores)
    w, h = map(int, args.image_size.split("x"))
    logdir = os.path.join(BENCH_DIR, "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    info = {"device": args.device, "cores": cores, "image_size": args.image_size, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "vllm_args": json.loads(args.vllm_args),
            "command": " ".join(["python", *sys.argv]), "machine": machine_info()}

    if args.cost_ratio:
        res = [cost_ratio(v, default_model(v), cores, logdir, args.vllm_args, (w, h), args.prompt_words,
                          args.max_tokens, device=args.device) for v in args.variants.split(",")]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"setup": info, "variants": res}, f, indent=1)
        return 0

    model = args.model or default_model(args.variant)
    if args.image_fractions:
        fractions = [Fraction(x).limit_denominator(1000) for x in args.image_fractions.split(",")]
    else:
        fractions = [Fraction(1, args.image_every) if args.image_every else Fraction(0)]
    n = 40 if args.quick else args.requests
    rows = []
    # Built once (images are encoded to PNG here): every system gets the very same requests.
    warmup = workload(4, 10.0, Fraction(1, 2), args.prompt_words, (w, h), seed=99)
    runs = [(rate, frac, workload(n, rate, frac, args.prompt_words, (w, h), seed=int(rate * 1000)))
            for rate in [float(r) for r in args.rates.split(",")] for frac in fractions]
    for name in args.systems.split(","):
        system = start_system(name, model, cores, logdir, args.vllm_args, device=args.device)
        try:
            asyncio.run(drive(system.url, warmup, 8))
            for rate, frac, reqs in runs:
                before = system.stage_totals()
                results, duration = asyncio.run(drive(system.url, reqs, args.max_tokens))
                time.sleep(0.5)  # the gateway observes a request just after its last byte
                stages = stage_means(before, system.stage_totals())
                rows.append(summarize(name, rate, frac, results, duration, stages))
                print(f"{name} @ {rate} req/s, {float(frac):.0%} images: done "
                      f"({rows[-1]['failed']} failed, {duration:.0f} s)", flush=True)
        finally:
            system.stop()
    print_table(rows)
    info.update(model=model, requests_per_run=n, image_fractions=[float(f) for f in fractions])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": info, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"{os.path.basename(model)} on cores {cores}; {args.image_size} images; "
                              f"{n} requests per run, {args.max_tokens} output tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
