"""Gateway workers against a hostile tenant: ``bench/hostile.py`` once per ``--workers`` count, back to
back, with the same attacks, quotas and cores, then one JSON with every run, one table and one plot.

Each run is a fresh ``bench/hostile.py`` process (a process cannot undo its ``--hostile-nice``, and the
stub LM and legitimate clients it starts would inherit it). Cores: ``--gateway-cores all`` by default,
so in every run the gateway's processes, the clients and the stub LM share every core and the runs
differ in the worker count alone (with one worker pinned to a core of its own and two spread over all,
the comparison would be of the pinning too). The attacks default to the big-body kinds, where one
worker's event loop is what the legitimate tenant waits for.

Targets, per attack and run (each against that run's own baseline): the legitimate tenant's p99 within
``P99_TARGET_X`` x its baseline, and its success >= 99 % on REST and on gRPC.

    python bench/hostile_workers.py --workers 1,2 --json bench/results/hostile-cpu-workers.json \\
        --plot bench/results/hostile-cpu-workers.png -- --phase-s 10

Arguments after ``--`` go to every ``bench/hostile.py`` run. Each run's own JSON (with its time series)
stays in ``bench/results/logs/hostile-workers-<N>.json``; the combined JSON holds them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gateway import machine

from services.common.spawn import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG_BODY = ("grpc-over", "grpc-at-limit", "rest-declared", "rest-chunked", "rest-at-limit", "upload-headers")
"""The attacks compared by default: bodies at or over the gateway's size limit, and an upload's headers."""
ATTACKER_QUOTA = '{"max_in_flight": 16, "max_background": 8, "body_mib": 512}'
"""The attacker's quotas, as ``make bench-hostile`` gives them."""
P99_TARGET_X = 5.0
SUCCESS_TARGET = 0.99
SERIES = ("rss_samples", "gauge_samples", "legit_samples")
"""A run's time series (``bench/hostile.py``'s): written one line each."""


def compare(runs: dict[int, dict]) -> list[dict]:
    """One row per (workers, phase) from each run's ``bench/hostile.py`` JSON: the legitimate tenant's
    success and latency (p99 against the run's own baseline, ``p99_x``, the one the targets read, and
    against the first run's, ``p99_x_first``: a noisy baseline moves only the first), where the host's
    CPU went, the gateway's peak RSS, the release, and the targets met."""
    rows = []
    first = next(iter(runs.values()))["baseline"]["p99_ms"] if runs else None
    for workers, doc in runs.items():
        for phase in [doc["baseline"], *doc["attacks"]]:
            rest, grpc, x = phase["rest_success"], phase["grpc_success"], phase.get("p99_vs_baseline", 1.0)
            rows.append({"workers": workers, "attack": phase.get("attack", "baseline"), "rest_success": rest,
                         "grpc_success": grpc, "p50_ms": phase["p50_ms"], "p99_ms": phase["p99_ms"], "p99_x": x,
                         "p99_x_first": round(phase["p99_ms"] / first, 2) if phase["p99_ms"] and first else None,
                         **{k: phase.get(k) for k in ("gateway_cpu_pct", "bench_cpu_pct", "other_cpu_pct",
                                                      "host_cpu_pct", "steal_pct", "rss_hwm_mib", "released_s")},
                         "met": {"success_99": (rest or 0) >= SUCCESS_TARGET and (grpc or 0) >= SUCCESS_TARGET,
                                 "p99_5x": x is not None and x <= P99_TARGET_X}})
    return rows


def table(rows: list[dict]) -> str:
    """The comparison as a Markdown table, a row per (phase, worker count)."""
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    lines = ["| attack | workers | REST ok % | gRPC ok % | p50 ms | p99 ms | p99 x (own baseline) | p99 x (1st run's) "
             "| CPU %: gateway / clients+stub / others | met |", "|---|" + "---|" * 9]
    order = list(dict.fromkeys(r["attack"] for r in rows))
    for r in sorted(rows, key=lambda r: (order.index(r["attack"]), r["workers"])):
        met = "" if r["attack"] == "baseline" else ("**yes**" if all(r["met"].values()) else "no" + (
            "" if r["met"]["success_99"] else " (ok %)") + ("" if r["met"]["p99_5x"] else " (p99)"))
        cpu = " / ".join(fmt(r.get(k), "{:.0f}") for k in ("gateway_cpu_pct", "bench_cpu_pct", "other_cpu_pct"))
        lines.append(f"| {r['attack']} | {r['workers']} | {fmt(_pc(r['rest_success']))} | {fmt(_pc(r['grpc_success']))} "
                     f"| {fmt(r['p50_ms'])} | {fmt(r['p99_ms'], '{:,.0f}')} | {fmt(r['p99_x'])} | "
                     f"{fmt(r['p99_x_first'])} | {cpu} | {met} |")
    return "\n".join(lines)


def _pc(v: float | None) -> float | None:
    return None if v is None else 100 * v


def write_json(path: str, doc: dict) -> None:
    """``doc`` indented, but each run's time series on one line."""
    runs = doc["runs"]
    marks = {f"@series:{w}:{k}@": json.dumps(run[k], separators=(",", ":")) for w, run in runs.items()
             for k in SERIES if k in run}
    slim = dict(doc, runs={w: {k: (f"@series:{w}:{k}@" if k in SERIES else v) for k, v in run.items()}
                           for w, run in runs.items()})
    text = json.dumps(slim, indent=1)
    for mark, series in marks.items():
        text = text.replace(json.dumps(mark), series)
    with open(path, "w") as f:
        f.write(text + "\n")


def run_one(workers: int, args, extra: list[str]) -> dict:
    """One ``bench/hostile.py`` run with ``workers``; its JSON."""
    out = os.path.join(ROOT, "bench", "results", "logs", f"hostile-workers-{workers}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "hostile.py"), "--workers", str(workers),
           "--gateway-cores", args.gateway_cores, "--kinds", args.kinds, "--attacker-quota", args.attacker_quota,
           "--json", out, *extra]
    print(f"== {workers} worker(s): {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=child_env())
    with open(out) as f:
        return json.load(f)


def plot(rows: list[dict], runs: dict[int, dict], path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(runs)
    attacks = [a for a in dict.fromkeys(r["attack"] for r in rows) if a != "baseline"]
    by = {(r["attack"], r["workers"]): r for r in rows}
    fig = plt.figure(figsize=(15, 9))
    grid = fig.add_gridspec(2, max(3, len(counts)))
    bars = [fig.add_subplot(grid[0, i]) for i in range(3)]
    width = 0.8 / len(counts)
    for j, w in enumerate(counts):
        xs = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(attacks))]
        rs = [by.get((a, w), {}) for a in attacks]
        ok = [min(_pc(r.get("rest_success")) or 0, _pc(r.get("grpc_success")) or 0) for r in rs]
        label = f"{w} worker{'s' if w > 1 else ''}"
        bars[0].bar(xs, [r.get("p99_x") or 0 for r in rs], width, color=f"C{j}", label=label)
        bars[1].bar(xs, ok, width, color=f"C{j}", label=label)
        bottom = [0.0] * len(rs)
        for k, (key, hatch) in enumerate((("gateway_cpu_pct", ""), ("bench_cpu_pct", "//"), ("other_cpu_pct", ".."))):
            vals = [r.get(key) or 0 for r in rs]
            bars[2].bar(xs, vals, width, bottom=bottom, color=f"C{j}", alpha=1.0 - 0.3 * k, hatch=hatch,
                        label=f"{label}: {key.split('_')[0].replace('bench', 'clients+stub')}")
            bottom = [b + v for b, v in zip(bottom, vals)]
    bars[0].axhline(P99_TARGET_X, color="red", ls=":", label=f"{P99_TARGET_X:g}x target")
    bars[0].set_yscale("log")
    bars[0].set_title("legit p99 / its baseline's p99")
    bars[1].axhline(100 * SUCCESS_TARGET, color="red", ls=":", label="99 % target")
    bars[1].set_title("legit success, the lower of REST and gRPC (%)")
    bars[2].set_title("host CPU (% of one core): gateway, clients+stub, others")
    for ax in bars:
        ax.set_xticks(range(len(attacks)), attacks, rotation=30, fontsize=7)
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.legend(fontsize=7)
    for j, w in enumerate(counts):
        ax = fig.add_subplot(grid[1, j])
        doc = runs[w]
        for a in doc["attacks"]:
            ax.axvspan(a["t0_s"], a["t1_s"], color="C3", alpha=0.08)
            ax.text((a["t0_s"] + a["t1_s"]) / 2, 0.98, a["attack"], transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=6, rotation=90)
        for i, kind in enumerate(("rest", "rest-image", "grpc")):
            ok = [(s[0], s[2]) for s in doc["legit_samples"] if s[1] == kind and s[3] == "ok"]
            bad = [(s[0], max(s[2], 1.0)) for s in doc["legit_samples"] if s[1] == kind and s[3] != "ok"]
            if ok:
                ax.scatter(*zip(*ok), s=2, color=f"C{i}", label=f"{kind} ok")
            if bad:
                ax.scatter(*zip(*bad), s=12, marker="x", color=f"C{i}", label=f"{kind} failed")
        ax.set_yscale("log")
        ax.set_title(f"{w} worker{'s' if w > 1 else ''}: legit latency (ms) over the run", fontsize=9)
        ax.set_xlabel("s since the baseline began (shaded: attacks)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle(f"epd-serve gateway workers under big-body attacks, one run each; {info['cpu']} ({info['cores']} "
                 f"cores, shared by every process), {info['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts, one run each, in order")
    ap.add_argument("--kinds", default=",".join(BIG_BODY), help="the attacks (bench/hostile.py --kinds)")
    ap.add_argument("--attacker-quota", default=ATTACKER_QUOTA, help="bench/hostile.py --attacker-quota")
    ap.add_argument("--gateway-cores", default="all", help="bench/hostile.py --gateway-cores, the same for every run")
    ap.add_argument("--json", help="write every run and the comparison here")
    ap.add_argument("--plot", help="write a PNG plot here")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    counts = [int(w) for w in args.workers.split(",") if w]
    info = machine(["python", "bench/hostile_workers.py", *sys.argv[1:]])
    runs = {w: run_one(w, args, extra) for w in counts}
    rows = compare(runs)
    print("\n" + table(rows))
    print(f"targets: legit p99 <= {P99_TARGET_X:g}x its baseline, legit success >= {100 * SUCCESS_TARGET:g} % on "
          "REST and gRPC; CPU in % of one core (others: the host's busy time less the gateway's and the bench's)")
    setup = {"workers": counts, "kinds": args.kinds.split(","), "attacker_quota": json.loads(args.attacker_quota),
             "gateway_cores": args.gateway_cores, "hostile_args": extra, "p99_target_x": P99_TARGET_X,
             "success_target": SUCCESS_TARGET}
    if args.json:
        write_json(args.json, {"machine": info, "setup": setup, "comparison": rows, "runs": runs})
    if args.plot:
        plot(rows, runs, args.plot, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
