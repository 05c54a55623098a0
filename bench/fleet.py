"""Fleet benchmark (issue 33): multi-turn image conversations on 2 encoders and 2 LMs, routed by load and
routed by what each LM's prefix cache holds, in one run on the same cores.

Workload: ``--conversations`` chats of 4-8 turns, ``--concurrency`` of them at a time. Each chat is about
one image drawn Zipf-like (``--zipf``) from a pool of ``--images`` (popular images are shared across
users), or, for a ``--text-share`` of them, about a text of its own (no image: routed by its prefix keys
alone); every turn re-sends the whole history (the image, the questions, the answers the server gave),
as chat clients do. Every request streams; the client measures TTFT.

Systems (the same deployment shape, ``services.up.Deployment``: 2 encoders on half the cores, ``--lms`` LMs
(2) on the other half, one gateway):

* ``load``: ``--lm-routing load``, least outstanding requests, encoders by affinity, no host tier (what
  the gateway and encoders did before issue 33);
* ``cache``: ``--lm-routing cache`` (the default): the LM whose prefix cache holds most of the request's
  prompt (its prefix keys and images, ``services.fleet_memory``), unless it has ``--lm-spill`` more requests
  in flight than the least busy LM; encoders as in ``load``;
* ``cache+tier``: ``cache`` with the encoders' host tier (``--host-tier-mib``, its default) and images
  sent to the encoder that holds their output (``--encoder-routing held``): today's defaults;
* ``cache-spill1`` (not in the default list): ``cache`` with ``--lm-spill 1`` (load wins sooner);
* ``one-lm``: the yardstick for the ideal hit rate: 2 encoders and one LM, whose prefix cache sees every
  prompt of the workload (it fits), on the same LM cores (no host tier).

Rows: TTFT p50/p99; vLLM's prefix-cache hit rate (hits/queries over the LMs, from their
``vllm:prefix_cache_*`` counters), against ``one-lm``'s (``prefix_hit_of_one_lm``) and against a lower
bound computed from the workload (``prefix_hit_ideal``: each turn finds its previous turn's prompt, in whole
KV blocks; images shared between conversations are hit beyond it); vision encoder runs per unique image; CPU seconds per request (every process of the
deployment); the routing decisions. Not in this run: vLLM's ``ECCPUConnector`` (issue 34 measures it) and
Mooncake (docs/benchmarks.md says why).

    python bench/fleet.py --json bench/results/fleet-cpu.json --plot bench/results/fleet-cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_info, pct

from services.up import Deployment

BLOCK = 128  # vLLM's CPU KV block (tokens): the prefix cache keeps and finds whole blocks
QUESTION = "What is in this picture? " + "Describe every shape and colour in it. " * 20


def conversations(n: int, images: int, zipf: float, seed: int, text_share: float = 0.0) -> list[tuple[int, int]]:
    """``(image seed, turns)`` per conversation: images Zipf-distributed over ``images``, 4-8 turns; -1 (no
    image) for a ``text_share`` of them."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf for k in range(images)]
    return [(-1 if text_share and rng.random() < text_share else rng.choices(range(images), weights)[0], rng.randint(4, 8))
            for _ in range(n)]


def first_message(image: int, conversation: int = 0) -> dict:
    """The first turn's message: about ``image``, or (-1) a text of the conversation's own, as long."""
    from tools.media import data_url, make_image

    if image < 0:
        return {"role": "user", "content": f"Conversation {conversation}. Tell me about the sea. "
                                           + "Waves, tides, salt and wind. " * 40}

    return {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(5000 + image, (224, 224)))}},
        {"type": "text", "text": QUESTION}]}


async def turn(session, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "status": resp.status, "error": (await resp.text())[:300]}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return {"ok": ttft is not None, "ttft": ttft, "text": text, "prompt_tokens": usage.get("prompt_tokens", 0),
            "status": 200}


async def run_workload(url: str, model: str, convs, concurrency: int, max_tokens: int) -> list[dict]:
    results: list[dict] = []
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def chat(i: int, image: int, turns: int) -> None:
            async with gate:
                messages = [first_message(image, i)]
                previous = 0
                for t in range(turns):
                    r = await turn(session, url, model, messages, max_tokens)
                    r.update(conversation=i, turn=t, image=image, previous_prompt=previous)
                    results.append(r)
                    if not r["ok"]:
                        return
                    previous = r["prompt_tokens"]
                    messages = [*messages, {"role": "assistant", "content": r["text"]},
                                {"role": "user", "content": f"Tell me more, point {t + 1}."}]

        await asyncio.gather(*(chat(i, image, turns) for i, (image, turns) in enumerate(convs)))
    return results


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = out.get(m.group(1) + (m.group(2) or ""), 0.0) + float(m.group(3))
    return out


def total(samples: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and label in k)


def cpu_seconds(dep: Deployment) -> float:
    procs = []
    for svc in dep.services:
        try:
            p = psutil.Process(svc.proc.pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    s = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            s += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return s


def deployment(system: str, model: str, args) -> Deployment:
    """``load``, ``cache`` (``cache-spillN``: with ``--lm-spill N``), ``cache+tier`` (the encoders' host tier
    and ``--encoder-routing held``), or ``one-lm``: the ideal's yardstick, one LM whose prefix cache sees
    every prompt (the workload fits in it), on the same LM cores."""
    system, tier = system.removesuffix("+tier"), system.endswith("+tier")
    encoders = [] if tier else ["--host-tier-mib", "0"]
    if system == "one-lm":
        return Deployment(model=model, quiet=True, n_encoders=2, n_lms=1, encoder_args=encoders,
                          gateway_args=["--encoder-routing", "held" if tier else "affinity",
                                        "--affinity-spill", str(args.affinity_spill),
                                        "--held-spill", str(args.held_spill)])
    routing, _, spill = system.partition("-spill")
    return Deployment(model=model, quiet=True, n_encoders=2, n_lms=args.lms, encoder_args=encoders,
                      gateway_args=["--lm-routing", routing, "--lm-spill", spill or str(args.lm_spill),
                                    "--encoder-routing", "held" if tier else "affinity",
                                    "--affinity-spill", str(args.affinity_spill), "--held-spill", str(args.held_spill)])


def measure(system: str, model: str, convs, args) -> dict:
    dep = deployment(system, model, args)
    dep.start()
    try:
        served = json.loads(urllib.request.urlopen(dep.url + "/v1/models", timeout=10).read())["data"][0]["id"]
        before = {"lm": [scrape(lm.metrics_port) for lm in dep.lms], "enc": [scrape(e.metrics_port) for e in dep.encoders],
                  "gw": scrape(dep.gateway_metrics), "cpu": cpu_seconds(dep)}
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(dep.url + "/v1/chat/completions", served, convs, args.concurrency,
                                           args.max_tokens))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # counters that trail the answers
        after = {"lm": [scrape(lm.metrics_port) for lm in dep.lms], "enc": [scrape(e.metrics_port) for e in dep.encoders],
                 "gw": scrape(dep.gateway_metrics), "cpu": cpu_seconds(dep)}
    finally:
        dep.stop()

    def delta(side: str, name: str, label: str = "") -> float:
        if side == "gw":
            return total(after["gw"], name, label) - total(before["gw"], name, label)
        return sum(total(a, name, label) - total(b, name, label) for a, b in zip(after[side], before[side]))

    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    hits, queries = delta("lm", "vllm:prefix_cache_hits_total"), delta("lm", "vllm:prefix_cache_queries_total")
    ideal = sum(r["previous_prompt"] // BLOCK * BLOCK for r in ok) / max(1.0, sum(r["prompt_tokens"] for r in ok))
    unique = len({image for image, _ in convs if image >= 0})
    return {
        "system": system, "requests": len(results), "failed": len(results) - len(ok), "wall_s": round(wall, 1),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1), "ttft_p99_ms": round(pct(ttfts, 0.99) * 1000, 1),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0, "prefix_hit_ideal": round(ideal, 4),
        "vision_runs": delta("enc", "epd_encoder_vision_runs_total"), "unique_images": unique,
        "encodes_per_unique_image": round(delta("enc", "epd_encoder_vision_runs_total") / unique, 2) if unique else None,
        "cpu_s_per_request": round((after["cpu"] - before["cpu"]) / max(1, len(results)), 3),
        "routing": {d: delta("gw", "epd_gateway_lm_routing_total", f'decision="{d}"') for d in ("held", "spill", "load")},
        "encoder_routing": {d: delta("gw", "epd_gateway_encoder_routing_total", f'decision="{d}"')
                            for d in ("held", "affinity", "spill")},
    }


def print_table(rows: list[dict]) -> None:
    cols = ["system", "requests", "failed", "ttft_p50_ms", "ttft_p99_ms", "prefix_hit_rate", "prefix_hit_of_one_lm",
            "prefix_hit_ideal", "encodes_per_unique_image", "cpu_s_per_request", "wall_s"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols), "| routing", r["routing"], "| encoders", r["encoder_routing"])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [r["system"] for r in rows]
    axes[0].bar(names, [r["prefix_hit_rate"] for r in rows])
    axes[0].set_title("prefix-cache hit rate")
    axes[1].bar([f"{n} p50" for n in names] + [f"{n} p99" for n in names],
                [r["ttft_p50_ms"] for r in rows] + [r["ttft_p99_ms"] for r in rows])
    axes[1].set_title("TTFT (ms)")
    axes[2].bar(names, [r["cpu_s_per_request"] for r in rows])
    axes[2].set_title("CPU s / request")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model directory (default: the built-in tiny model)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--images", type=int, default=8, help="the image pool conversations draw from")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--text-share", type=float, default=0.0, help="the share of conversations without an image")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lm-spill", type=int, default=2)
    p.add_argument("--lms", type=int, default=2, help="LMs of every system but one-lm")
    p.add_argument("--affinity-spill", type=int, default=4, help="the gateway's --affinity-spill (its default: 4)")
    p.add_argument("--held-spill", type=int, default=16, help="the gateway's --held-spill (its default: 16)")
    p.add_argument("--systems", default="one-lm,load,cache,cache+tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()
    from services.cli import default_model

    model = args.model or default_model()
    convs = conversations(args.conversations, args.images, args.zipf, args.seed, args.text_share)
    rows = [measure(s, model, convs, args) for s in args.systems.split(",")]
    one = next((r for r in rows if r["system"] == "one-lm"), None)
    for r in rows:  # against the measured ideal: one LM that saw every prompt
        r["prefix_hit_of_one_lm"] = round(r["prefix_hit_rate"] / one["prefix_hit_rate"], 3) \
            if one and one["prefix_hit_rate"] else None
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
