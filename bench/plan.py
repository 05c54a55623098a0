"""Fleet planner by simulation: checks the model against this host's capacity runs, then sizes a
128-GPU fleet on a bursty day whose image share shifts.

1. Validation. For each row of the capacity runs (``bench/results/capacity-cpu-*.json``: colocated on
   the Intel host, epd on the AMD host, workloads random-mm and mixed), the simulator runs the same
   workload (30 requests, Poisson, the row's rate) with the host's CPU profile, ``repeats`` times with
   different seeds, and reports the median TTFT p50/p99 over those runs (and the 10-90 % band) beside
   the measured ones. A row is within tolerance if both are within 20 %.
2. 128 GPUs. The H100 profile, one day (``day`` in the inputs): colocated (every GPU an LM that
   encodes in its steps), every static split E:LM of the fleet, and two autoscalers (the simulator's
   own, ``sim.autoscale``, and the project's, ``services/autoscale/policy.py``) moving GPUs between the
   roles, each started from the best static split and from the median one. The simulator's own holds
   every GPU all day. The project's gives idle instances back, so its cap is raised until its day's
   average GPUs are the statics' (at most): equal GPU-hours. Goodput is the requests per second that met both objectives (TTFT,
   TPOT), over the day.

    python bench/plan.py --split-step 4 --dense 18:32   # every 4th split and 18..32 (make bench-sim)
    python bench/plan.py                      # every split: about 4x that
    python bench/plan.py --quick              # fewer repeats, every 8th split: a smoke run

Writes ``bench/results/sim-validation.{json,png}`` and ``bench/results/sim-128gpu.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # services/, for its policy

from sim.autoscale import AutoscaleConfig, Autoscaler
from sim.costs import load_profile, load_section
from sim.fleet import Fleet
from sim.trace import capacity_trace, day_trace

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 0.2
CLIENT = "client (vllm bench)"

# (system, workload, result file, profile): the real rows the model is checked against.
REAL = [
    ("colocated", "random-mm", "capacity-cpu-random-mm.json", "cpu-intel-colocated"),
    ("colocated", "mixed", "capacity-cpu-mixed.json", "cpu-intel-colocated"),
    ("epd", "random-mm", "capacity-cpu-random-mm-executor.json", "cpu-amd-epd"),
    ("epd", "mixed", "capacity-cpu-mixed-executor.json", "cpu-amd-epd"),
]


def _fleet(system: str, profile, **kw) -> Fleet:
    if system == "colocated":
        return Fleet(profile, n_lm=kw.get("n_lm", 1), colocated=True, slowdown=kw.get("slowdown", 1.0))
    return Fleet(profile, n_enc=kw.get("n_enc", 1), n_lm=kw.get("n_lm", 1), **{k: v for k, v in kw.items()
                                                                                 if k not in ("n_enc", "n_lm")})


def validate(repeats: int) -> list[dict]:
    v = load_section("validation")
    rows = []
    for system, workload, name, prof in REAL:
        profile = load_profile(prof)
        with open(os.path.join(RESULTS, name)) as f:
            real = json.load(f)["results"][system]
        base = real[0]["cores_busy"].get(CLIENT, 0.0)
        for r in real:
            # The load generator shares the host's cores: its measured share, over the lowest rate's
            # (the costs were fitted there), stretches every engine step.
            w = v["client_weight"]
            slowdown = (1.0 - w * base) / (1.0 - w * r["cores_busy"].get(CLIENT, 0.0))
            p50, p99, att = [], [], []
            for seed in range(repeats):
                tr = capacity_trace(workload, r["rate"], v["requests"], seed, image_tokens=v["image_tokens"],
                                    text_tokens=v["text_tokens"], mixed_text_tokens=v["mixed_text_tokens"],
                                    out_tokens=v["out_tokens"])
                res = _fleet(system, profile, slowdown=slowdown).run(tr)
                ms = res.ttft * 1000
                p50.append(np.percentile(ms, 50))
                p99.append(np.percentile(ms, 99))
                att.append(float(res.met(v["slo_ttft_s"], v["slo_tpot_s"]).mean()))
            row = {"system": system, "workload": workload, "profile": prof, "source": name, "rate": r["rate"],
                   "real_ttft_p50_ms": r["ttft_ms"]["p50"], "real_ttft_p99_ms": r["ttft_ms"]["p99"],
                   "real_attainment": r["attainment"], "slowdown": round(slowdown, 3),
                   "sim_ttft_p50_ms": round(float(np.median(p50)), 1), "sim_ttft_p99_ms": round(float(np.median(p99)), 1),
                   "sim_ttft_p50_band_ms": [round(float(x), 1) for x in np.percentile(p50, [10, 90])],
                   "sim_ttft_p99_band_ms": [round(float(x), 1) for x in np.percentile(p99, [10, 90])],
                   "sim_attainment": round(float(np.median(att)), 3)}
            for q in ("p50", "p99"):
                err = row[f"sim_ttft_{q}_ms"] / row[f"real_ttft_{q}_ms"] - 1.0
                row[f"err_{q}"] = round(err, 3)
            row["within"] = abs(row["err_p50"]) <= TOLERANCE and abs(row["err_p99"]) <= TOLERANCE
            rows.append(row)
    return rows


def _hourly(res, cfg: dict, slo: tuple[float, float]) -> list[float]:
    met = res.met(*slo)
    hour = (res.t_arr // cfg["hour_s"]).astype(int)
    return [round(float(met[hour == h].mean()), 3) if (hour == h).any() else None for h in range(cfg["hours"])]


def _summary(name: str, res, cfg: dict, slo, length: float, **extra) -> dict:
    met = res.met(*slo)
    return {"system": name, "goodput": round(float(met.sum()) / length, 2), "attainment": round(float(met.mean()), 4),
            "ttft_p50_s": round(float(np.percentile(res.ttft, 50)), 3), "ttft_p99_s": round(float(np.percentile(res.ttft, 99)), 3),
            "tpot_p50_ms": round(float(np.percentile(res.tpot, 50)) * 1000, 1),
            "tpot_p99_ms": round(float(np.percentile(res.tpot, 99)) * 1000, 1),
            "avg_gpus": round(res.gpu_s / res.end_s, 2), "hourly_attainment": _hourly(res, cfg, slo), **extra}


def _reusable(path: str | None, setup: dict) -> dict[int, dict]:
    """Static rows of an earlier run of the same day (same GPUs, seed, scale and day inputs), by encoders."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        old = json.load(f)
    same = all(old["setup"].get(k) == setup[k] for k in ("gpus", "seed", "scale", "day", "slo_ttft_s", "slo_tpot_s"))
    return {s["encoders"]: s for s in old["statics"]} if same else {}


def fleet_day(gpus: int, split_step: int, seed: int, scale: float, start_enc: int | None, dense: range = range(0),
              reuse: str | None = None, log=print) -> dict:
    cfg = load_section("day")
    profile = load_profile("h100-7b-vlm")
    trace = day_trace(cfg, seed, scale=scale * gpus / cfg["gpus"])
    length = cfg["hours"] * cfg["hour_s"]
    slo = (cfg["slo_ttft_s"], cfg["slo_tpot_s"])
    log(f"day: {len(trace)} requests over {length:.0f} s, {int((trace.n_img > 0).sum())} with images, {gpus} GPUs")
    t0 = time.time()
    out = {"colocated": _summary("colocated", Fleet(profile, n_lm=gpus, colocated=True).run(trace), cfg, slo, length)}
    log(f"  colocated: goodput {out['colocated']['goodput']} ({time.time() - t0:.0f} s)")
    setup = {"gpus": gpus, "seed": seed, "scale": scale, "day": cfg, "slo_ttft_s": slo[0], "slo_tpot_s": slo[1]}
    known = _reusable(reuse, setup)
    statics = []
    for n_enc in sorted(set(range(1, gpus, split_step)) | {gpus - 1} | {n for n in dense if 0 < n < gpus}):
        if n_enc in known:
            statics.append(known[n_enc])
            continue
        t1 = time.time()
        s = _summary(f"static {n_enc}:{gpus - n_enc}", Fleet(profile, n_enc=n_enc, n_lm=gpus - n_enc).run(trace), cfg,
                     slo, length, encoders=n_enc, lms=gpus - n_enc)
        statics.append(s)
        log(f"  {s['system']}: goodput {s['goodput']} attainment {s['attainment']} ({time.time() - t1:.0f} s)")
    ranked = sorted(statics, key=lambda s: s["goodput"])
    best, median = ranked[-1], ranked[(len(ranked) - 1) // 2]
    # Both autoscalers from the best static split (can they improve on it?) and from another one (the median
    # static split unless --start-encoders names one): can they find a good split from a bad one?
    other = median["encoders"] if start_enc is None else start_enc
    runs = {}
    for start in (best["encoders"], other):
        runs[start] = (_sim_autoscaler_day(profile, trace, cfg, slo, length, gpus, start, log),
                       _local_policy_equal(profile, trace, cfg, slo, length, gpus, start, log))
    (auto, local), (auto_o, local_o) = runs[best["encoders"]], runs[other]
    return {"setup": {**setup, "requests": len(trace), "length_s": length, "split_step": split_step,
                      "dense": [dense.start, dense.stop - 1] if len(dense) else None,
                      "splits_simulated": len(statics)},
            "colocated": out["colocated"], "statics": statics, "best_static": best["system"],
            "median_static": median["system"], "autoscaler": auto, "autoscaler_local": local,
            "other_start": {"autoscaler": auto_o, "autoscaler_local": local_o},
            "autoscaler_vs_best": round(auto["goodput"] / max(best["goodput"], 1e-9), 3),
            "autoscaler_vs_median": round(auto["goodput"] / max(median["goodput"], 1e-9), 3),
            "local_vs_best": round(local["goodput"] / max(best["goodput"], 1e-9), 3),
            "local_vs_median": round(local["goodput"] / max(median["goodput"], 1e-9), 3),
            "local_other_start_vs_best": round(local_o["goodput"] / max(best["goodput"], 1e-9), 3),
            "colocated_vs_best": round(out["colocated"]["goodput"] / max(best["goodput"], 1e-9), 3)}


def _timeline(res) -> list:
    return [[round(t, 2), e, m, h] for t, e, m, h in res.timeline]


def _sim_autoscaler_day(profile, trace, cfg: dict, slo, length: float, gpus: int, start_enc: int, log) -> dict:
    """The simulator's own autoscaler (``sim.autoscale``), a budget and a floor of ``gpus``."""
    scaler = Autoscaler(AutoscaleConfig(tick_s=cfg["provision_s"] / 2, budget=gpus, min_gpus=gpus,
                                        cooldown_s=cfg["provision_s"] * 2, max_step=max(1, gpus // 32)))
    t1 = time.time()
    res = Fleet(profile, n_enc=start_enc, n_lm=gpus - start_enc, autoscaler=scaler,
                provision_s=cfg["provision_s"]).run(trace)
    auto = _summary("autoscaler", res, cfg, slo, length, start_encoders=start_enc, actions=len(scaler.actions),
                    timeline=_timeline(res))
    log(f"  autoscaler from {start_enc}: goodput {auto['goodput']} avg GPUs {auto['avg_gpus']} "
        f"({time.time() - t1:.0f} s)")
    return auto


CAP_STEP = 2
"""GPUs the local policy's cap grows by per try while its day's average stays under the fleet's."""


def _local_policy_equal(profile, trace, cfg: dict, slo, length: float, gpus: int, start_enc: int, log) -> dict:
    """The project's policy at the statics' GPU-hours: it gives instances back when a role is idle, so at a
    cap of ``gpus`` its day holds fewer GPUs on average than a static split. The cap is raised by
    ``CAP_STEP`` while the day's average stays at or under ``gpus`` and still grows (a cap it does not
    reach changes nothing); the last run that stayed there is the answer (its cap, and the run at
    ``gpus``, in the row)."""
    at_gpus = best = _local_policy_day(profile, trace, cfg, slo, length, gpus, start_enc, log)
    cap = gpus
    while best["avg_gpus"] < gpus - 0.5:
        cap += CAP_STEP
        run = _local_policy_day(profile, trace, cfg, slo, length, gpus, start_enc, log, cap=cap)
        if run["avg_gpus"] > gpus or run["avg_gpus"] <= best["avg_gpus"]:
            break  # past the statics' GPU-hours, or a cap it no longer reaches
        best = run
    return {**best, "at_cap_gpus": {k: at_gpus[k] for k in ("goodput", "attainment", "avg_gpus")}}


def _local_policy_day(profile, trace, cfg: dict, slo, length: float, gpus: int, start_enc: int, log,
                      cap: int | None = None) -> dict:
    """The project's own policy (``services/autoscale/policy.py``) on the same day, its GPU budget (``cap``,
    default ``gpus``) as its memory budget, its objectives the day's, up to ``gpus // 32`` instances a step
    (as the simulator's own); its timers scaled to the compressed day with the provisioning delay (rise 1x,
    fall 3x, cool-down 2x ``provision_s``); every other setting its default."""
    from sim.local_policy import LocalPolicy

    from services.autoscale.policy import Budget

    prov = cfg["provision_s"]
    cap = cap or gpus
    budget = Budget(min_encoders=1, max_encoders=cap - 1, min_lms=1, max_lms=cap - 1, max_memory_gib=cap,
                    ttft_s=slo[0], tpot_s=slo[1], max_step=max(1, gpus // 32),
                    up_after_s=prov, down_after_s=3 * prov, cooldown_s=2 * prov)
    scaler = LocalPolicy(budget, tick_s=prov / 2)
    t1 = time.time()
    res = Fleet(profile, n_enc=start_enc, n_lm=gpus - start_enc, autoscaler=scaler, provision_s=prov).run(trace)
    local = _summary("local policy", res, cfg, slo, length, start_encoders=start_enc, cap_gpus=cap,
                     actions=sum(k for _, _, k in scaler.actions), timeline=_timeline(res))
    log(f"  local policy from {start_enc}, cap {cap}: goodput {local['goodput']} avg GPUs {local['avg_gpus']} "
        f"({time.time() - t1:.0f} s)")
    return local


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 repeats, every 8th split")
    p.add_argument("--repeats", type=int, default=None, help="simulated runs per validation row")
    p.add_argument("--split-step", type=int, default=None, help="simulate every Nth static split (1: all)")
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the day's rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-encoders", type=int, default=None,
                   help="the autoscalers' second start (encoders; default: the median static split's); "
                        "the first is always the best static split")
    p.add_argument("--dense", default="", help="LO:HI: also every split with LO..HI encoders")
    p.add_argument("--reuse", default=None,
                   help="an earlier sim-128gpu.json of the same day: its static rows are not simulated again")
    p.add_argument("--skip-validation", action="store_true")
    p.add_argument("--skip-fleet", action="store_true")
    p.add_argument("--json-validation", default=os.path.join(RESULTS, "sim-validation.json"))
    p.add_argument("--json-fleet", default=os.path.join(RESULTS, "sim-128gpu.json"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()
    repeats = args.repeats or (20 if args.quick else load_section("validation")["repeats"])
    step = args.split_step or (8 if args.quick else 1)
    from sim.report import plot_fleet, plot_validation, print_fleet, print_validation

    if not args.skip_validation:
        rows = validate(repeats)
        print_validation(rows)
        _dump(args.json_validation, {"repeats": repeats, "tolerance": TOLERANCE, "rows": rows})
        if not args.no_plot:
            plot_validation(rows, args.json_validation.replace(".json", ".png"))
    if not args.skip_fleet:
        lo, _, hi = args.dense.partition(":")
        dense = range(int(lo), int(hi) + 1) if args.dense else range(0)
        day = fleet_day(args.gpus, step, args.seed, args.scale, args.start_encoders, dense, args.reuse)
        print_fleet(day)
        _dump(args.json_fleet, day)
        if not args.no_plot:
            plot_fleet(day, args.json_fleet.replace(".json", ".png"))
    return 0


def _dump(path: str, data: dict) -> None:
    data = {**data, "command": "python bench/plan.py " + " ".join(sys.argv[1:])}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
