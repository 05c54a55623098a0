"""Capacity sweep with the ecosystem's load generator: ``vllm bench serve`` against each system.

For each system (``bench/serving.py``'s ``System``: the same cores, the same engine settings) and
each request rate, this runs vLLM's own benchmark client (``vllm.benchmarks.serve``; the CPU wheel's
``vllm`` CLI cannot start, so its functions are called directly) with ``--backend openai-chat`` on
a multimodal workload, and reads its result file: completed and failed requests, throughput,
goodput at the stated objectives (``--goodput ttft:MS tpot:MS``), TTFT/TPOT percentiles. SLO
attainment is the share of the requests that met both objectives (goodput x duration / requests). The knee of a system is the highest rate up to
which every measured rate kept attainment at or above ``--knee`` (0.9).

Workloads:

* ``random-mm``: vLLM's synthetic multimodal dataset, one image per request (``--image-size``),
  ``--input-len`` random text tokens, ``--output-len`` tokens out (``--ignore-eos``).
* ``mixed``: the seed's mixed traffic through vLLM's ``custom_image`` dataset: a JSONL of prompts
  where every ``--image-every``-th carries an image (written here), the others are text only.
* ``multi-image``: every request is a long text shared by all requests (``--shared-words``; a system
  prompt's place) then 2 to ``--max-images`` images (``--image-size``), each after a short caption, then a
  question (the default 3: four of the ``bench-light`` model's images, about 490 tokens each, and the shared
  text exceed its 2048-token context):
  what prefill in step with arrival is for (``--systems epd,epd-wait``: the LM computing the text and
  the first images while later ones are still encoded and moved, against waiting for all of them).
* ``long-short``: ``mixed`` where every ``--long-every``-th prompt is ``--long-words`` words of text
  and the others one sentence: long prefills among short ones, the traffic a prefill tier is for
  (``--systems epd,epd-pd,vllm-epd``: what the P -> D hop costs in TTFT and buys in TPOT).

Run on a host with its capacity in mind: rates are chosen relative to the host (the default list
suits the 2-core CPU machine and the ``bench-light`` model).

    python bench/capacity.py --systems colocated,epd --rates 0.5,1,2,4 --workload random-mm \\
        --json bench/results/capacity-cpu-random-mm.json --plot bench/results/capacity-cpu-random-mm.png
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/machine.py and serving.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import machine_info
from serving import SYSTEMS, VLLM_ENV, parse_cores, stage_means, start_system

from services.common.spawn import child_env

RUNNER = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


LONG_WORDS = ("the river light stone cloud north window garden silver market evening paper quiet engine summer "
              "letter mountain bridge winter forest harbor lantern orchard").split()


def _mixed_dataset(path: str, n: int, image_every: int, image_size: int, offset: int = 0,
                   long_every: int = 0, long_words: int = 0) -> None:
    """vLLM's ``custom_image`` dataset format: one JSON object per line, a prompt and its image files
    (every ``image_every``-th request one image, the others none; with ``long_every``, every
    ``long_every``-th prompt is ``long_words`` words of text, the others one short sentence)."""
    from tools.media import make_image

    with open(path, "w") as f:
        for i in range(n):
            files = []
            if image_every and i % image_every == image_every - 1:
                files.append(os.path.join(os.path.dirname(path), f"img{i}.png"))
                with open(files[-1], "wb") as img:
                    img.write(make_image(50_000 + 1000 * offset + i, (image_size, image_size)))
            text = f"Summarize item {offset}-{i}: the river light stone cloud north window garden."
            if long_every and i % long_every == 0:
                words = (LONG_WORDS[(i + k) % len(LONG_WORDS)] for k in range(long_words))
                text = f"Summarize document {offset}-{i}: " + " ".join(words)
            row = {"content": [*({"type": "image", "image": p} for p in files), {"type": "text", "text": text}]}
            f.write(json.dumps(row) + "\n")


def _multi_image_dataset(path: str, n: int, image_size: int, offset: int, shared_words: int,
                         max_images: int = 3) -> None:
    """``custom_image`` rows: the shared text, then 2 to ``max_images`` captioned images (request i has
    2 + i % (max_images - 1)), then a question; every image is new (``offset`` differs per rate)."""
    from tools.media import make_image

    shared = "You are a careful analyst. " + " ".join(LONG_WORDS[k % len(LONG_WORDS)] for k in range(shared_words))
    with open(path, "w") as f:
        for i in range(n):
            content: list[dict] = [{"type": "text", "text": shared}]
            for j in range(2 + i % (max_images - 1)):
                name = os.path.join(os.path.dirname(path), f"multi{offset}-{i}-{j}.png")
                with open(name, "wb") as img:
                    img.write(make_image(70_000 + 10_000 * offset + 10 * i + j, (image_size, image_size)))
                content += [{"type": "text", "text": f" Figure {j + 1}:"}, {"type": "image", "image": name}]
            content.append({"type": "text", "text": f" Compare the figures of case {offset}-{i}."})
            f.write(json.dumps({"content": content}) + "\n")


def bench_args(args, url: str, served: str, rate: float, result: str, dataset: str, seed: int) -> list[str]:
    argv = ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", served, "--tokenizer", args.model, "--num-prompts", str(args.num_prompts),
            "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
            "--num-warmups", str(args.warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
            "--save-result", "--result-dir", os.path.dirname(result), "--result-filename", os.path.basename(result),
            "--temperature", "0"]
    if args.workload == "random-mm":
        argv += ["--dataset-name", "random-mm", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                 "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
                 "--random-mm-limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
                 "--random-mm-bucket-config", json.dumps({f"({args.image_size}, {args.image_size}, 1)": 1.0})]
    else:
        argv += ["--dataset-name", "custom_image", "--dataset-path", dataset, "--custom-output-len",
                 str(args.output_len), "--disable-shuffle", "--custom-ensure-client-side-data"]  # data: URLs
    return argv


def run_rate(args, url: str, served: str, rate: float, workdir: str, index: int, system=None) -> dict:
    """One rate; ``index`` makes its requests (images, texts) differ from every other rate's, so
    no rate finds the previous one's images in a cache. With ``system`` (a running
    ``serving.System``), the row also gets the CPU milliseconds each of its processes spent per
    completed request over the rate (warm-ups included, a few percent) and, for epd systems, the
    gateway's mean per stage."""
    result = os.path.join(workdir, f"r{rate}.json")
    dataset = os.path.join(workdir, f"mixed-{index}.jsonl")
    if args.workload in ("mixed", "long-short"):
        long_every = args.long_every if args.workload == "long-short" else 0
        _mixed_dataset(dataset, args.num_prompts, args.image_every, args.image_size, offset=index,
                       long_every=long_every, long_words=args.long_words)
    elif args.workload == "multi-image":
        _multi_image_dataset(dataset, args.num_prompts, args.image_size, index, args.shared_words, args.max_images)
    env = child_env(VLLM_ENV)
    cpu0 = system.cpu_seconds() if system is not None else {}
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load generator: the one child waited for
    stages0 = _stage_totals(system)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", RUNNER, *bench_args(args, url, served, rate, result, dataset,
                                                                      seed=1000 * (index + 1))],
                          capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if proc.returncode != 0 or not os.path.exists(result):
        return {"rate": rate, "error": (proc.stderr or proc.stdout)[-1500:]}
    with open(result) as f:
        r = json.load(f)
    extra = {}
    done = r.get("completed") or 0
    if system is not None and done:
        cpu1 = system.cpu_seconds()
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # The load generator shares the machine (it makes and encodes every image): its CPU counts too.
        cpu1["client (vllm bench)"] = client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime
        used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1 if cpu1[k] - cpu0.get(k, 0.0) > 0}
        wall = time.monotonic() - t0
        extra["cpu_ms_per_request"] = {k: round(1000 * v / done, 1) for k, v in used.items()}
        # Cores each process kept busy over the rate (1.0 = one core all the time). vLLM's CPU engine
        # keeps its core busy while it has requests (its OpenMP threads spin between kernels), so at
        # low rates CPU per request overstates the work; at the knee, this names the bottleneck.
        extra["cores_busy"] = {k: round(v / wall, 2) for k, v in used.items()}
        stages1 = _stage_totals(system)
        if stages1:
            extra["stage_ms"] = stage_means(stages0, stages1)
    n = r.get("num_prompts") or args.num_prompts
    good = r.get("request_goodput") or 0.0
    met = good * (r.get("duration") or 0.0)  # requests that met both objectives
    return {
        "rate": rate, "wall_s": round(time.monotonic() - t0, 1), "completed": r.get("completed"),
        "failed": r.get("failed", n - (r.get("completed") or 0)),
        "errors": sorted({e for e in r.get("errors", []) if e})[:3],
        "req_per_s": round(r.get("request_throughput", 0.0), 3), "goodput": round(good, 3),
        "attainment": round(min(1.0, met / n), 3) if n else None,
        "out_tok_per_s": round(r.get("output_throughput", 0.0), 1),
        **{f"{m}_ms": {"p50": round(r.get(f"median_{m}_ms", 0.0), 1), "p99": round(r.get(f"p99_{m}_ms", 0.0), 1)}
           for m in ("ttft", "tpot", "itl", "e2el")},
        **extra,
    }


def _stage_totals(system) -> dict:
    try:
        return system.stage_totals() if system is not None else {}
    except OSError:  # a front without the histograms
        return {}


def knee(rows: list[dict], threshold: float) -> float | None:
    """The highest rate up to which every measured rate kept attainment >= ``threshold``."""
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        if r.get("attainment") is None or r["attainment"] < threshold:
            break
        best = r["rate"]
    return best


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        rows = [r for r in rows if "error" not in r]
        a1.plot([r["rate"] for r in rows], [r["attainment"] for r in rows], marker="o", label=name)
        a2.plot([r["rate"] for r in rows], [r["goodput"] for r in rows], marker="o", label=name)
    a1.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05))
    a2.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write(args, results: dict) -> None:
    if not args.json:
        return
    out = {"setup": {**{k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                     "command": " ".join(["python", *sys.argv]), "machine": machine_info()},
           "results": results, "knees": {n: knee(rows, args.knee) for n, rows in results.items()}}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model directory (default: the bench-light variant)")
    p.add_argument("--systems", default="colocated,epd")
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--workload", choices=["random-mm", "mixed", "long-short", "multi-image"], default="random-mm")
    p.add_argument("--shared-words", type=int, default=250, help="multi-image: words of the text every request "
                   "starts with")
    p.add_argument("--max-images", type=int, default=3, help="multi-image: images in the largest request (>= 2)")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--image-every", type=int, default=10, help="mixed, long-short: every n-th request has an image")
    p.add_argument("--long-every", type=int, default=4, help="long-short: every n-th prompt is long text")
    p.add_argument("--long-words", type=int, default=500, help="long-short: words in a long prompt")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--knee", type=float, default=0.9)
    p.add_argument("--warmups", type=int, default=3, help="requests before each rate's measurement (vLLM's "
                   "--num-warmups): the first rate after a system starts would pay its warm-up")
    p.add_argument("--cores", default="")
    p.add_argument("--vllm-args", default="{}")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per rate")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()
    if not args.model:
        from services.cli import default_model

        args.model = default_model("bench-light")
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    rates = [float(r) for r in args.rates.split(",") if r]
    cores = parse_cores(args.cores)
    workdir = tempfile.mkdtemp(prefix="epd-capacity-")
    results: dict[str, list[dict]] = {}
    for name in systems:
        try:
            system = start_system(name, args.model, cores, workdir, args.vllm_args)
        except RuntimeError as e:  # one system that cannot start does not lose the others' rows
            print(f"{name}: {e}", flush=True)
            results[name] = [{"rate": rate, "error": f"did not start: {e}"} for rate in rates]
            continue
        try:
            base = f"http://127.0.0.1:{system.port}"
            with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
                served = json.load(r)["data"][0]["id"]
            rows = []
            os.makedirs(os.path.join(workdir, name), exist_ok=True)
            for index, rate in enumerate(rates):
                row = run_rate(args, base, served, rate, os.path.join(workdir, name), index, system)
                rows.append(row)
                print(json.dumps({"system": name, **row}), flush=True)
            results[name] = rows
        finally:
            system.stop()
        _write(args, results)  # after every system: a later failure keeps what was measured
    print(f"\n{'system':<12}{'rate':>6}{'done':>6}{'fail':>6}{'req/s':>8}{'goodput':>9}{'attain':>8}"
          f"{'TTFT50':>9}{'TTFT99':>9}{'TPOT50':>8}{'TPOT99':>8}")
    for name, rows in results.items():
        for r in rows:
            if "error" in r:
                print(f"{name:<12}{r['rate']:>6}  error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
                continue
            print(f"{name:<12}{r['rate']:>6}{r['completed']:>6}{r['failed']:>6}{r['req_per_s']:>8}{r['goodput']:>9}"
                  f"{r['attainment']:>8}{r['ttft_ms']['p50']:>9}{r['ttft_ms']['p99']:>9}{r['tpot_ms']['p50']:>8}"
                  f"{r['tpot_ms']['p99']:>8}")
        k = knee(rows, args.knee)
        print(f"{name:<12} knee (attainment >= {args.knee}): {k} req/s")
        at = next((r for r in rows if r["rate"] == k), None)
        if at and at.get("cpu_ms_per_request"):
            print(f"{'':<12} CPU ms per request at the knee (cores busy): "
                  + ", ".join(f"{p} {v} ({at['cores_busy'][p]})" for p, v in sorted(at["cpu_ms_per_request"].items())))
    _write(args, results)
    if args.plot:
        plot(results, args.plot, f"{args.workload}: SLO ttft<={args.slo_ttft_ms:g} ms, tpot<={args.slo_tpot_ms:g} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
