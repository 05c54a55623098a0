"""Serving benchmark: the seed's mixed workload, colocated vLLM vs epd-serve.

Workload: Poisson arrivals at a fixed rate; every ``--image-every``-th request
carries a large image, the rest are text. Every request streams, and the client
measures TTFT, TPOT (mean inter-token time after the first token) and ITL per
request. Systems, on the same cores (``--cores``, default: all of this machine):

* ``colocated``: one vLLM engine (our LM service without encoders: it encodes
  images itself, as plain vLLM does) on all cores, behind the gateway;
* ``epd``: encoder on half the cores, LM on the other half (1E1PD), same gateway.

Both use the ``bench`` variant of the built-in model (a larger vision tower, so
one image costs a realistic number of decode steps) unless ``--model`` says
otherwise. The same script runs a real model on a GPU host (``--model``).

    python bench/serving.py --quick --json bench/results/serving-cpu.json --plot bench/results/serving-cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from services.common.images import data_url, make_image  # noqa: E402
from services.up import Service, free_port, grpc_serving, http_ok  # noqa: E402

WORDS = ("the river light stone cloud north window garden silver market evening paper quiet "
         "engine summer letter mountain bridge winter forest harbor lantern orchard").split()


def workload(n: int, rate: float, image_every: int, prompt_words: int, image_size, seed: int = 0):
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        text = "Summarize: " + " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        content: list | str = text
        if image_every and i % image_every == image_every - 1:
            content = [{"type": "image_url", "image_url": {"url": data_url(make_image(seed * 100_000 + i, image_size))}},
                       {"type": "text", "text": text}]
        reqs.append((t, {"messages": [{"role": "user", "content": content}], "stream": True}))
    return reqs


async def one(session, url: str, body: dict, max_tokens: int, t_send: float) -> dict:
    body = dict(body, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    arrivals, n = [], 0
    async with session.post(url, json=body) as resp:
        status = resp.status
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                status = chunk["error"].get("code", 500)
                continue
            for c in chunk.get("choices", []):
                k = len(c.get("token_ids") or [])
                if k:
                    arrivals.append((time.perf_counter(), k))
                    n += k
    image = isinstance(body["messages"][0]["content"], list)
    if status != 200 or not arrivals:
        return {"ok": False, "image": image}
    ttft = arrivals[0][0] - t_send
    itls = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
    e2e = arrivals[-1][0] - t_send
    tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
    return {"ok": True, "image": image, "ttft": ttft, "tpot": tpot, "itls": itls, "e2e": e2e, "tokens": n}


async def drive(url: str, reqs, max_tokens: int) -> tuple[list[dict], float]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()

        async def at(offset, body):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one(session, url, body, max_tokens, time.perf_counter())

        results = await asyncio.gather(*(at(off, body) for off, body in reqs))
        return results, time.perf_counter() - t0


class System:
    """Starts one system's services as subprocesses on the given cores."""

    def __init__(self, name: str, model: str, cores: list[int], logdir: str, vllm_args: str) -> None:
        self.name = name
        fmt = lambda cs: ",".join(map(str, cs))  # noqa: E731
        common = ["--model", model, "--vllm-args", vllm_args]
        self.lm_addr = f"127.0.0.1:{free_port()}"
        self.port = free_port()
        self.services: list[Service] = []
        encoders = ""
        if name == "epd":
            half = max(1, len(cores) // 2)
            enc_addr = f"127.0.0.1:{free_port()}"
            self.services.append(Service("encoder", ["encoder", "--port", enc_addr.split(":")[1],
                                                     "--cpu-cores", fmt(cores[:half]), *common],
                                         os.path.join(logdir, f"{name}-encoder.log")))
            lm_cores, encoders = cores[half:] or cores, enc_addr
        else:
            lm_cores = cores
        self.lm_metrics = free_port()
        self.services.append(Service("lm", ["lm", "--port", self.lm_addr.split(":")[1], "--cpu-cores", fmt(lm_cores),
                                            "--metrics-port", str(self.lm_metrics), *common],
                                     os.path.join(logdir, f"{name}-lm.log")))
        self.gateway = Service("gateway", ["gateway", "--port", str(self.port), "--lms", self.lm_addr,
                                           "--encoders", encoders], os.path.join(logdir, f"{name}-gateway.log"))
        self.encoder_addr = encoders

    def start(self) -> "System":
        env = dict(os.environ)
        for s in self.services:
            s.start(env)
        deadline = time.monotonic() + 600
        addrs = [self.lm_addr] + ([self.encoder_addr] if self.encoder_addr else [])
        while not all(grpc_serving(a) for a in addrs):
            if time.monotonic() > deadline or not all(s.alive() for s in self.services):
                raise RuntimeError(f"{self.name} did not start:\n" + "\n".join(s.log_tail() for s in self.services))
            time.sleep(0.5)
        self.gateway.start(env)
        while not http_ok(f"http://127.0.0.1:{self.port}/health"):
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        for s in [self.gateway, *reversed(self.services)]:
            s.stop()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summarize(system: str, rate: float, results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    text = [r for r in ok if not r["image"]]
    image = [r for r in ok if r["image"]]
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731

    def stats(rs, key):
        vals = [r[key] for r in rs]
        return {"mean": ms(statistics.mean(vals)) if vals else None, "median": ms(statistics.median(vals)) if vals else None,
                "p99": ms(pct(vals, 0.99)) if vals else None}

    itls = [x for r in ok for x in r["itls"]]
    return {
        "system": system, "rate": rate, "requests": len(results), "failed": len(results) - len(ok),
        "duration_s": round(duration, 2), "req_per_s": round(len(ok) / duration, 3),
        "out_tok_per_s": round(sum(r["tokens"] for r in ok) / duration, 1),
        "ttft_ms": stats(ok, "ttft"), "tpot_ms": stats(ok, "tpot"),
        "itl_ms": {"mean": ms(statistics.mean(itls)) if itls else None, "median": ms(statistics.median(itls)) if itls else None,
                   "p99": ms(pct(itls, 0.99)) if itls else None},
        "text_tpot_ms": stats(text, "tpot"), "text_ttft_ms": stats(text, "ttft"),
        "image_ttft_ms": stats(image, "ttft"),
        "raw": {"text_tpot": [r["tpot"] for r in text], "ttft": [r["ttft"] for r in ok]},
    }


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'system':<10}{'rate':>5}{'req/s':>7}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
           f"{'TPOT p50':>10}{'TPOT p99':>10}{'textTPOT50':>11}{'textTPOT99':>11}{'imgTTFT50':>10}{'fail':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['system']:<10}{r['rate']:>5}{r['req_per_s']:>7}{r['out_tok_per_s']:>8}"
              f"{r['ttft_ms']['median']:>10}{r['ttft_ms']['p99']:>10}{r['tpot_ms']['median']:>10}{r['tpot_ms']['p99']:>10}"
              f"{r['text_tpot_ms']['median']:>11}{r['text_tpot_ms']['p99']:>11}{str(r['image_ttft_ms']['median']):>10}"
              f"{r['failed']:>5}")
    print("times in ms; TPOT = mean inter-token time after the first token; text* = text-only requests")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{r['system']}\n{r['rate']} req/s" for r in rows]
    axes[0].boxplot([[x * 1e3 for x in r["raw"]["ttft"]] for r in rows], tick_labels=labels, showfliers=True)
    axes[0].set_title("TTFT, all requests (ms)")
    axes[0].set_yscale("log")
    axes[1].boxplot([[x * 1e3 for x in r["raw"]["text_tpot"]] for r in rows], tick_labels=labels, showfliers=True)
    axes[1].set_title("TPOT, text-only requests (ms)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir or name (default: the built-in bench variant)")
    ap.add_argument("--systems", default="colocated,epd")
    ap.add_argument("--rates", default="1,2", help="requests per second, comma-separated")
    ap.add_argument("--requests", type=int, default=80, help="requests per rate")
    ap.add_argument("--image-every", type=int, default=10, help="every n-th request carries an image (0: none)")
    ap.add_argument("--image-size", default="768x512")
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cores", default="", help="cores both systems use, e.g. 0-7 (default: all)")
    ap.add_argument("--vllm-args", default="{}")
    ap.add_argument("--quick", action="store_true", help="40 requests per rate")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()

    from services.cli import default_model

    model = args.model or default_model("bench")
    cores = sorted(os.sched_getaffinity(0))
    if args.cores:
        a, _, b = args.cores.partition("-")
        cores = list(range(int(a), int(b or a) + 1))
    n = 40 if args.quick else args.requests
    w, h = map(int, args.image_size.split("x"))
    logdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    rows = []
    for name in args.systems.split(","):
        system = System(name, model, cores, logdir, args.vllm_args).start()
        try:
            url = f"http://127.0.0.1:{system.port}/v1/chat/completions"
            asyncio.run(drive(url, workload(4, 10.0, 2, args.prompt_words, (w, h), seed=99), 8))  # warm-up
            for rate in [float(r) for r in args.rates.split(",")]:
                reqs = workload(n, rate, args.image_every, args.prompt_words, (w, h), seed=int(rate * 1000))
                results, duration = asyncio.run(drive(url, reqs, args.max_tokens))
                rows.append(summarize(name, rate, results, duration))
                print(f"{name} @ {rate} req/s done", flush=True)
        finally:
            system.stop()
    print_table(rows)
    info = {"model": model, "cores": cores, "requests_per_rate": n, "image_every": args.image_every,
            "image_size": args.image_size, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": info, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"{os.path.basename(model)} on cores {cores}; every {args.image_every}th request "
                              f"has a {args.image_size} image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
