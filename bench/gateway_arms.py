"""The gateways ``bench/gateway.py`` compares in one run: one arm per (``--workers``, state store), every
arm a gateway of its own in front of the same stub LM, all of them measured in the same interleaved
rounds, so a busy host slows every arm alike.

An arm is ``w<N>`` (``--workers N``; with N > 1 the workers share their limits through the private store
their supervisor starts) or ``w1+store`` (one process that decides its limits in a private Redis this
benchmark starts, ``StoreServer``, and names with ``--state-store``): ``w1+store`` against ``w1`` is
what the store costs a request; ``w2`` against ``w1`` what a second worker buys.

A measured path is labelled ``<path>@<arm>`` (``rest@w2``); the direct paths (the LM called without a
gateway) carry no arm. The summaries here are pure functions of ``bench/gateway.py``'s rows
(``tests/unit/test_bench_gateway.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

STORES = ("none", "private")
P99_LIMIT_US = 50_000.0
"""The added p99 a gateway's throughput is read at (``frontier``)."""


@dataclass(frozen=True)
class Arm:
    workers: int
    store: str
    """``none`` (one process, its limits in its memory), ``private`` (one process, a private Redis this
    benchmark starts) or ``workers`` (N > 1: the supervisor's own private store)."""

    @property
    def label(self) -> str:
        return f"w{self.workers}" + ("+store" if self.store == "private" else "")

    def store_flags(self, store_url: str = "", password_file: str = "") -> list[str]:
        """The gateway's state-store flags for this arm (``store_url``/``password_file``: the private
        store, for ``private``; none for the others)."""
        if self.store != "private":
            return []
        return ["--state-store", store_url, "--state-store-password-file", password_file]


def arms(workers: list[int], stores: list[str]) -> list[Arm]:
    """Every (workers, store) asked for, in order, once: N > 1 workers always share through their
    supervisor's store, so ``--state-store`` does not make another arm of them."""
    out: list[Arm] = []
    for n in workers:
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        for store in stores:
            if store not in STORES:
                raise ValueError(f"state store must be one of {', '.join(STORES)}, got {store!r}")
            arm = Arm(n, "workers" if n > 1 else store)
            if arm not in out:
                out.append(arm)
    return out


def label(path: str, arm: Arm | None) -> str:
    return path if arm is None else f"{path}@{arm.label}"


def split_label(text: str) -> tuple[str, str | None]:
    """``rest@w2`` -> (``rest``, ``w2``); ``direct`` -> (``direct``, None)."""
    path, _, arm = text.partition("@")
    return path, arm or None


def frontier(rows: list[dict], limit_us: float = P99_LIMIT_US) -> list[dict]:
    """Per (arm, path, tokens): the most requests per second among the concurrencies whose added p99 is
    within ``limit_us`` (None: none is), the concurrency that gave it, and the added p99 (ms) at every
    concurrency measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("gateway") and r["added_p99_us"] is not None:
            groups.setdefault((r["gateway"], r["path"], r["max_tokens"]), []).append(r)
    out = []
    for (arm, path, tokens), rs in groups.items():
        rs.sort(key=lambda r: r["concurrency"])
        ok = [r for r in rs if r["added_p99_us"] <= limit_us and r["rps"]]
        best = max(ok, key=lambda r: r["rps"], default=None)
        out.append({"gateway": arm, "path": path, "max_tokens": tokens,
                    "rps": best["rps"] if best else None, "concurrency": best["concurrency"] if best else None,
                    "added_p99_ms": {r["concurrency"]: round(r["added_p99_us"] / 1e3, 2) for r in rs}})
    return out


def store_cost(rows: list[dict], with_store: str = "w1+store", without: str = "w1") -> list[dict]:
    """What the store adds to a request: per (path, tokens, concurrency) measured on both arms, the
    difference of their p50 and of their p99 (us)."""
    by = {(r.get("gateway"), r["path"], r["max_tokens"], r["concurrency"]): r for r in rows}
    out = []
    for (arm, path, tokens, c), r in by.items():
        base = by.get((without, path, tokens, c))
        if arm != with_store or base is None or r["p50_us"] is None or base["p50_us"] is None:
            continue
        out.append({"path": path, "max_tokens": tokens, "concurrency": c,
                    "p50_us": round(r["p50_us"] - base["p50_us"], 1), "p99_us": round(r["p99_us"] - base["p99_us"], 1)})
    return sorted(out, key=lambda x: (x["path"], x["max_tokens"], x["concurrency"]))


def print_summary(summary: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    limit = summary["p99_limit_ms"]
    print(f"\nthroughput at an added p99 <= {limit:g} ms (req/s, at concurrency); added p99 ms by concurrency:")
    for f in summary["frontier"]:
        at = f"{fmt(f['rps'])} (c={f['concurrency']})" if f["rps"] else "none"
        ms = ", ".join(f"c={c}: {v:g}" for c, v in f["added_p99_ms"].items())
        print(f"  {f['gateway']:<10}{f['path']:<13}{f['max_tokens']:>3} tok  {at:<16}{ms}")
    if summary["store"]:
        print("what the private state store adds per request (w1+store - w1), p50 / p99 us:")
        for s in summary["store"]:
            print(f"  {s['path']:<13}{s['max_tokens']:>3} tok  c={s['concurrency']:<4}{fmt(s['p50_us']):>8} /"
                  f" {fmt(s['p99_us'])}")


def plot(rows: list[dict], summary: dict, path: str, title: str) -> None:
    """Three panels: req/s, added p99 (with the limit) and the store's added p50/p99, by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    gws = list(dict.fromkeys(r["gateway"] for r in rows if r.get("gateway")))
    paths = list(dict.fromkeys(r["path"] for r in rows if r.get("gateway")))
    style = {p: ("-o", "--s", ":^", "-.v")[i % 4] for i, p in enumerate(paths)}
    for i, gw in enumerate(gws):
        for p in paths:
            for tokens in sorted({r["max_tokens"] for r in rows}):
                rs = sorted((r for r in rows if r.get("gateway") == gw and r["path"] == p and r["max_tokens"] == tokens
                             and r["added_p99_us"] is not None), key=lambda r: r["concurrency"])
                xs, lab = [r["concurrency"] for r in rs], f"{p}@{gw}, {tokens} tok"
                axes[0].plot(xs, [r["rps"] for r in rs], style[p], color=f"C{i}", label=lab, ms=4)
                axes[1].plot(xs, [r["added_p99_us"] / 1e3 for r in rs], style[p], color=f"C{i}", label=lab, ms=4)
    for j, (key, name) in enumerate((("p50_us", "p50"), ("p99_us", "p99"))):
        for p in paths:
            rs = [s for s in summary["store"] if s["path"] == p]
            axes[2].plot([s["concurrency"] for s in rs], [s[key] / 1e3 for s in rs], style[p], color=f"C{j + 3}",
                         label=f"{p}, {name}", ms=4)
    axes[0].set_title("requests per second (closed loop)")
    axes[1].set_title("added p99 (ms) = path - direct LM call")
    axes[1].axhline(summary["p99_limit_ms"], color="red", ls=":", label=f"{summary['p99_limit_ms']:g} ms")
    axes[1].set_yscale("symlog", linthresh=1.0)
    axes[1].set_ylim(bottom=0)
    axes[2].set_title("the state store's cost (ms) = w1+store - w1")
    axes[2].axhline(0, color="grey", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
