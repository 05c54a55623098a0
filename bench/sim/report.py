"""Tables (printed) and plots (PNG) of ``bench/plan.py``'s results. Reads the result dicts only."""

from __future__ import annotations


def print_validation(rows: list[dict]) -> None:
    print("\nValidation: simulated against measured TTFT (ms), 30-request runs; sim = median over seeds [10-90 %]")
    print(f"{'system':<10} {'workload':<9} {'rate':>4} | {'real p50':>8} {'sim p50':>8} {'err':>6} | "
          f"{'real p99':>8} {'sim p99':>8} {'sim p99 band':>15} {'err':>6} | within 20 %")
    for r in rows:
        band = "{:.0f}-{:.0f}".format(*r["sim_ttft_p99_band_ms"])
        print(f"{r['system']:<10} {r['workload']:<9} {r['rate']:>4g} | {r['real_ttft_p50_ms']:>8.1f} "
              f"{r['sim_ttft_p50_ms']:>8.1f} {r['err_p50']:>+6.0%} | {r['real_ttft_p99_ms']:>8.1f} "
              f"{r['sim_ttft_p99_ms']:>8.1f} {band:>15} {r['err_p99']:>+6.0%} | {'yes' if r['within'] else 'no'}")
    print(f"within 20 % on both: {sum(r['within'] for r in rows)} of {len(rows)} rows")


def print_fleet(day: dict) -> None:
    s = day["setup"]
    print(f"\n{s['gpus']} GPUs, one day in {s['length_s']:.0f} s, {s['requests']} requests; "
          f"objectives TTFT {s['slo_ttft_s']} s, TPOT {s['slo_tpot_s'] * 1000:.0f} ms")
    ranked = sorted(day["statics"], key=lambda x: x["goodput"])
    rows = [day["colocated"], ranked[-1], ranked[(len(ranked) - 1) // 2], day["autoscaler"]]
    names = ["colocated", "best static", "median static", "autoscaler"]
    if "autoscaler_local" in day:
        rows.append(day["autoscaler_local"])
        names.append("local policy")
    for key, name in (("autoscaler", "autoscaler"), ("autoscaler_local", "local policy")):
        if key in day.get("other_start", {}):
            r = day["other_start"][key]
            rows.append(r)
            names.append(f"{name} @{r['start_encoders']}")
    names = [n if "@" in n or n not in ("autoscaler", "local policy") else
             f"{n} @{r['start_encoders']}" for n, r in zip(names, rows)]
    print(f"{'':<18} {'system':<16} {'avg GPUs':>8} {'goodput':>8} {'attain':>7} {'TTFT p50/p99 s':>15} {'TPOT p50/p99 ms':>16}")
    for n, r in zip(names, rows):
        print(f"{n:<18} {r['system']:<16} {r['avg_gpus']:>8.1f} {r['goodput']:>8.1f} {r['attainment']:>7.3f} "
              f"{r['ttft_p50_s']:>7.2f}/{r['ttft_p99_s']:<7.2f} {r['tpot_p50_ms']:>7.1f}/{r['tpot_p99_ms']:<8.1f}")
    print(f"autoscaler / best static {day['autoscaler_vs_best']}x, / median static {day['autoscaler_vs_median']}x; "
          f"colocated / best static {day['colocated_vs_best']}x")
    if "local_vs_best" in day:
        print(f"local policy / best static {day['local_vs_best']}x, / median static {day['local_vs_median']}x; "
              f"from the other start / best static {day['local_other_start_vs_best']}x")


def plot_validation(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["system"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8))
    for ax, (system, workload) in zip(axes, groups):
        g = [r for r in rows if (r["system"], r["workload"]) == (system, workload)]
        x = [r["rate"] for r in g]
        for q, c in (("p50", "tab:blue"), ("p99", "tab:red")):
            ax.plot(x, [r[f"real_ttft_{q}_ms"] for r in g], "o-", color=c, label=f"real {q}")
            ax.plot(x, [r[f"sim_ttft_{q}_ms"] for r in g], "s--", color=c, alpha=0.7, label=f"sim {q}")
            lo, hi = zip(*(r[f"sim_ttft_{q}_band_ms"] for r in g))
            ax.fill_between(x, lo, hi, color=c, alpha=0.12)
        ax.set_yscale("log")
        ax.set_title(f"{system}, {workload}")
        ax.set_xlabel("offered req/s")
        ax.set_ylabel("TTFT ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Simulator against the 2-core capacity runs (band: 10-90 % of simulated 30-request runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fleet(day: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = day["setup"]
    hour_s = s["day"]["hour_s"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.2))
    tl = day["autoscaler"]["timeline"]
    a1.plot([t[0] / hour_s for t in tl], [t[1] for t in tl], label="encoders")
    a1.plot([t[0] / hour_s for t in tl], [t[2] for t in tl], label="LMs")
    a1.plot([t[0] / hour_s for t in tl], [t[3] for t in tl], ":", label="GPUs held")
    if "autoscaler_local" in day:
        tl = day["autoscaler_local"]["timeline"]
        a1.plot([t[0] / hour_s for t in tl], [t[1] for t in tl], "--", label="encoders (local policy)")
        a1.plot([t[0] / hour_s for t in tl], [t[2] for t in tl], "--", label="LMs (local policy)")
    a1.set_xlabel("hour of the day")
    a1.set_title("autoscalers: active instances")
    a1.legend(fontsize=8)
    ranked = sorted(day["statics"], key=lambda x: x["goodput"])
    extra = ((day["autoscaler_local"], "local policy"),) if "autoscaler_local" in day else ()
    for r, name in ((day["autoscaler"], "autoscaler"), *extra, (ranked[-1], "best static"),
                    (ranked[(len(ranked) - 1) // 2], "median static"), (day["colocated"], "colocated")):
        h = r["hourly_attainment"]
        a2.plot(range(len(h)), h, label=f"{name} ({r['system']})")
    a2.set_xlabel("hour of the day")
    a2.set_title("attainment (TTFT and TPOT met), per hour")
    a2.set_ylim(0, 1.05)
    a2.legend(fontsize=7)
    a3.plot([r["encoders"] for r in day["statics"]], [r["goodput"] for r in day["statics"]], ".-", label="static E:LM")
    a3.axhline(day["autoscaler"]["goodput"], color="tab:green", label="autoscaler")
    a3.axhline(day["colocated"]["goodput"], color="tab:red", ls="--", label="colocated")
    if "autoscaler_local" in day:
        a3.axhline(day["autoscaler_local"]["goodput"], color="tab:orange", ls=":", label="local policy")
    for key, color in (("autoscaler", "tab:green"), ("autoscaler_local", "tab:orange")):
        r = day.get("other_start", {}).get(key)
        if r is not None:
            a3.plot([r["start_encoders"]], [r["goodput"]], "o", color=color,
                    label=f"{'autoscaler' if key == 'autoscaler' else 'local policy'} from {r['start_encoders']}")
    a3.set_xlabel(f"encoders of {s['gpus']} GPUs (static)")
    a3.set_ylabel("goodput req/s")
    a3.set_title("goodput over the day")
    a3.legend(fontsize=8)
    for a in (a1, a2, a3):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
