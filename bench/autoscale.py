"""The local autoscaler (``epd up --autoscale``) under a shifting workload, against a static 1E+1LM fleet,
in one run on the same cores.

Workload: open-loop Poisson arrivals, streaming, in three phases of ``--phase-s`` seconds: text-heavy
(``--text-rate`` requests/s, ``--text-image-share`` of them carry images), image-heavy (``--image-rate``,
``--image-share``: most carry ``--images-per-chat`` images of their own, never seen before, so each is a
vision run), then text-heavy again. The same seeded sequence for both systems.

Systems (``services.up.Deployment``, 1 encoder + 1 LM at start, on the tiny model's ``--variant``;
``bench-light`` by default: the tiny LM with a vision tower heavy enough that encoding is real work):

* ``static``: that fleet, never changed;
* ``autoscaled``: the same, with ``services.autoscale.loop.Autoscaler`` (``--max-encoders``, ``--max-lms``,
  thresholds and timers as flags) scraping every ``--interval-s``.

Rows per system and phase: requests, failed (non-200 or a broken stream), TTFT p50/p90, TPOT p50, the share
that met both objectives (TTFT <= ``--ttft-ms``, TPOT <= ``--tpot-ms``; the gateway's own defaults), and the
mean number of serving encoders and LMs. The autoscaler's actions are listed with their times and how
long each took (an add: until the gateway routes to the new instance; a remove: the drain and exit).

    python bench/autoscale.py --json bench/results/autoscale-cpu.json --plot bench/results/autoscale-cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_info, pct

from services.autoscale.loop import Autoscaler
from services.autoscale.policy import Budget
from services.up import Deployment

PHASES = ("text-heavy", "image-heavy", "text-heavy-again")


def image_url(seed: int, size: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(6):
        x, y = rng.randrange(size), rng.randrange(size)
        img.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, min(size, x + size // 3), min(size, y + size // 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(rng: random.Random, image_share: float, images: int, size: int, max_tokens: int, serial: int) -> dict:
    content: list[dict] = []
    if rng.random() < image_share:
        content += [{"type": "image_url", "image_url": {"url": image_url(serial * 16 + k, size)}} for k in range(images)]
    content.append({"type": "text", "text": f"Request {serial}: tell me about it in a few words."})
    return {"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def one(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> dict:
    start = time.monotonic()
    rec = {"t": round(start - t0, 2), "image": isinstance(body["messages"][0]["content"][0].get("image_url"), dict),
           "ok": False, "ttft_ms": None, "tpot_ms": None}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            first = last = None
            tokens = 0
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = str(event["error"])[:200]
                    return rec
                if event.get("choices"):  # vLLM sends its first chunk once the first token is out
                    now = time.monotonic()
                    first = first or now
                    last = now
                if event.get("usage"):
                    tokens = event["usage"].get("completion_tokens", 0)
            if first is None:
                rec["error"] = "no chunk"
                return rec
            rec.update(ok=True, ttft_ms=(first - start) * 1e3,
                       tpot_ms=(last - first) * 1e3 / (tokens - 1) if tokens > 1 else 0.0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec["error"] = repr(e)[:200]
    return rec


async def drive(url: str, args, seed: int) -> list[dict]:
    """The three phases as open-loop Poisson arrivals (``--text-rate``/``--image-rate`` requests per second:
    the rate does not fall when the server slows down, as a closed loop's would); every request's record,
    with its phase. At most ``--max-in-flight`` at once (more are counted as failed, never queued here)."""
    t0 = time.monotonic()
    records: list[dict] = []
    tasks: set[asyncio.Task] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for p, phase in enumerate(PHASES):
            image_phase = phase == "image-heavy"
            share = args.image_share if image_phase else args.text_image_share
            rate = args.image_rate if image_phase else args.text_rate
            rng = random.Random(seed * 1000 + p)
            end = time.monotonic() + args.phase_s
            serial = (seed * 10 + p) * 100000
            while (now := time.monotonic()) < end:
                await asyncio.sleep(rng.expovariate(rate))
                serial += 1
                body = chat(rng, share, args.images_per_chat, args.image_size, args.max_tokens, serial)
                if len(tasks) >= args.max_in_flight:
                    records.append({"t": round(now - t0, 2), "phase": phase, "ok": False, "image": False,
                                    "ttft_ms": None, "tpot_ms": None, "error": "client: too many in flight"})
                    continue

                async def send(body=body, phase=phase):
                    rec = await one(session, url, body, t0)
                    rec["phase"] = phase
                    records.append(rec)

                task = asyncio.create_task(send())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return records


async def warm_up(url: str, args) -> None:
    """A few chats with and without images, one at a time, before anything is measured."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for k in range(4):
            await one(session, url, chat(random.Random(k), k % 2, args.images_per_chat, args.image_size,
                                         args.max_tokens, 10**9 + k), time.monotonic())


def summarize(records: list[dict], args) -> dict:
    ok = [r for r in records if r["ok"]]
    met = [r for r in ok if r["ttft_ms"] <= args.ttft_ms and r["tpot_ms"] <= args.tpot_ms]
    return {"requests": len(records), "failed": len(records) - len(ok),
            "image_share": round(sum(r["image"] for r in records) / max(1, len(records)), 2),
            "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 0.5), "ttft_p90_ms": pct([r["ttft_ms"] for r in ok], 0.9),
            "tpot_p50_ms": pct([r["tpot_ms"] for r in ok], 0.5),
            "attainment": round(len(met) / max(1, len(records)), 3)}


def run_system(name: str, model: str, args) -> dict:
    dep = Deployment(model=model, quiet=True, drain_grace_s=args.drain_grace_s).start(timeout=900)
    scaler = None
    try:
        asyncio.run(warm_up(dep.url, args))  # the engines' first requests are slow: not a load the scaler sees
        if name == "autoscaled":
            budget = Budget(max_encoders=args.max_encoders, max_lms=args.max_lms, up_threshold=args.up_threshold,
                            down_threshold=args.down_threshold, up_after_s=args.up_after_s,
                            down_after_s=args.down_after_s, cooldown_s=args.cooldown_s,
                            ttft_s=args.ttft_ms / 1000, tpot_s=args.tpot_ms / 1000)
            scaler = Autoscaler(dep, budget, interval_s=args.interval_s).start()
        records = asyncio.run(drive(dep.url, args, args.seed))
    finally:
        if scaler is not None:
            scaler.stop()
        dep.stop()
    history = scaler.history if scaler is not None else []
    out = {"system": name, "phases": {}, "events": scaler.events if scaler is not None else [],
           "history": history, "records": records}
    for phase in PHASES:
        rows = [r for r in records if r["phase"] == phase]
        row = summarize(rows, args)
        if rows and history:
            lo, hi = min(r["t"] for r in rows), max(r["t"] for r in rows)
            h = [s for s in history if lo <= s["t"] <= hi]
            row["encoders_mean"] = round(sum(s["encoders"] for s in h) / max(1, len(h)), 2)
            row["lms_mean"] = round(sum(s["lms"] for s in h) / max(1, len(h)), 2)
        elif rows:
            row["encoders_mean"], row["lms_mean"] = 1.0, 1.0
        out["phases"][phase] = row
    return out


def plot(results: list[dict], path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for res in results:
        if res["history"]:
            t = [s["t"] for s in res["history"]]
            ax1.step(t, [s["encoders"] for s in res["history"]], where="post", label="encoders (autoscaled)")
            ax1.step(t, [s["lms"] for s in res["history"]], where="post", label="LMs (autoscaled)")
        bucket = 10.0
        recs = res["records"]
        if recs:
            n = int(max(r["t"] for r in recs) // bucket) + 1
            xs, ys = [], []
            for b in range(n):
                rows = [r for r in recs if b * bucket <= r["t"] < (b + 1) * bucket]
                if rows:
                    met = [r for r in rows if r["ok"] and r["ttft_ms"] <= args.ttft_ms and r["tpot_ms"] <= args.tpot_ms]
                    xs.append((b + 0.5) * bucket)
                    ys.append(len(met) / len(rows))
            ax2.plot(xs, ys, marker="o", label=res["system"])
    for k in range(1, len(PHASES)):
        for ax in (ax1, ax2):
            ax.axvline(k * args.phase_s, color="grey", ls=":")
    ax1.set_ylabel("instances serving")
    ax1.legend(loc="upper right")
    ax2.set_ylabel(f"attainment (TTFT<={args.ttft_ms:.0f} ms, TPOT<={args.tpot_ms:.0f} ms)")
    ax2.set_xlabel("seconds (phases: " + ", ".join(PHASES) + ")")
    ax2.set_ylim(0, 1.05)
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="bench-light", help="tiny model variant (tiny, bench-light, bench)")
    p.add_argument("--systems", default="static,autoscaled")
    p.add_argument("--phase-s", type=float, default=90.0)
    p.add_argument("--text-rate", type=float, default=3.0, help="requests per second in the text-heavy phases")
    p.add_argument("--image-rate", type=float, default=1.5, help="requests per second in the image-heavy phase")
    p.add_argument("--max-in-flight", type=int, default=48)
    p.add_argument("--image-share", type=float, default=0.9)
    p.add_argument("--text-image-share", type=float, default=0.03)
    p.add_argument("--images-per-chat", type=int, default=2)
    p.add_argument("--image-size", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=200.0)
    p.add_argument("--max-encoders", type=int, default=2)
    p.add_argument("--max-lms", type=int, default=1)
    p.add_argument("--up-threshold", type=float, default=0.75, help="lateness (the policy's Budget)")
    p.add_argument("--down-threshold", type=float, default=0.4, help="lateness (the policy's Budget)")
    p.add_argument("--up-after-s", type=float, default=6.0)
    p.add_argument("--down-after-s", type=float, default=12.0)
    p.add_argument("--cooldown-s", type=float, default=15.0)
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--drain-grace-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()

    from services.cli import default_model

    model = default_model(args.variant)
    results = [run_system(name, model, args) for name in args.systems.split(",") if name]
    print(f"{'system':<11} {'phase':<17} {'reqs':>5} {'fail':>5} {'img':>5} {'ttft p50':>9} {'ttft p90':>9} "
          f"{'tpot p50':>9} {'attain':>7} {'E':>5} {'LM':>5}")
    for res in results:
        for phase, row in res["phases"].items():
            print(f"{res['system']:<11} {phase:<17} {row['requests']:>5} {row['failed']:>5} {row['image_share']:>5} "
                  f"{row['ttft_p50_ms'] or 0:>9.0f} {row['ttft_p90_ms'] or 0:>9.0f} {row['tpot_p50_ms'] or 0:>9.1f} "
                  f"{row['attainment']:>7.2f} {row.get('encoders_mean', 0):>5} {row.get('lms_mean', 0):>5}")
        for e in res["events"]:
            print(f"  {res['system']}: t={e['t']:>6}s {e['kind']} {e['role']} {e.get('address', '')} "
                  f"took {e['took_s']}s ({e['reason']}){'' if e.get('ok') else ' FAILED: ' + e.get('error', '')}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "model": model,
                       "results": [{k: v for k, v in r.items() if k != "records"} | {"records": r["records"]}
                                   for r in results]}, f, indent=1)
    if args.plot:
        plot(results, args.plot, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
