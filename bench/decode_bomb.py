"""Decoder-bomb benchmark: while one client uploads small audio files that decode to huge ones, do
another client's transcriptions keep their success rate and latency, and do the encoder and the LM
stay within their Kubernetes memory limits?

A real deployment (``epd up``'s ``Deployment``: one encoder, one LM, the gateway) runs on the tiny
offline Whisper. The run:

1. ``baseline`` (``--phase-s``): the legit client alone, ``--legit-tasks`` tasks each posting a
   3 s 16 kHz WAV to ``/v1/audio/transcriptions`` back to back;
2. ``bomb`` (``--phase-s``): the same, and ``--clients`` attacker tasks each posting, back to back, a
   FLAC of ``--bomb-seconds`` of silence at ``--bomb-rate`` Hz (a 192 kHz, 349 s one is about 200 KB
   and decodes to 256 MiB of float32 before the resampler's copies) to the same route.

Measured per phase: the legit client's success rate and latency (p50, p99), how each bomb was
answered (status and the first message), and the peak resident memory of each service's process
tree (the service and its vLLM EngineCore, psutil every 50 ms) against its container's memory limit
in ``docker/k8s/base/{encoder,lm}.yaml``. Targets: legit success >= 99 %, each peak within its limit.

    python bench/decode_bomb.py --json bench/results/decode-bomb-cpu.json --plot bench/results/decode-bomb-cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.hostile import manifest_memory_limit, write_json  # noqa: E402
from bench.machine import machine_info, pct  # noqa: E402
from services.autoscale.loop import tree_rss  # noqa: E402
from services.cli import default_model  # noqa: E402
from services.up import Deployment  # noqa: E402
from tools.media import make_audio  # noqa: E402

ROUTE = "/v1/audio/transcriptions"
MIB = 1 << 20
ROLES = ("encoder", "lm", "gateway")


def bomb_flac(seconds: float, rate: int) -> bytes:
    """``seconds`` of silence at ``rate`` Hz, mono 16-bit FLAC: a few hundred bytes a second."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), dtype=np.int16), rate, format="FLAC")
    return buf.getvalue()


class Sampler(threading.Thread):
    """Samples each service's tree RSS every ``period_s`` into ``samples`` as (t, {role: bytes})."""

    def __init__(self, pids: dict[str, int], t0: float, period_s: float = 0.05) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pids, self.t0, self.period_s = pids, t0, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.samples.append((time.monotonic() - self.t0, {r: tree_rss(p) for r, p in self.pids.items()}))

    def peak(self, a: float, b: float) -> dict[str, float]:
        """Each role's peak in MiB over [a, b] (seconds since t0)."""
        inside = [s for t, s in self.samples if a <= t <= b]
        return {r: max((s[r] for s in inside), default=0) / MIB for r in self.pids}


async def post(session: aiohttp.ClientSession, url: str, clip: bytes, name: str, model: str) -> tuple[int, str]:
    form = aiohttp.FormData()
    form.add_field("file", clip, filename=name, content_type="application/octet-stream")
    form.add_field("model", model)
    form.add_field("language", "en")
    form.add_field("temperature", "0")
    async with session.post(url + ROUTE, data=form) as r:
        return r.status, (await r.text())[:240]


async def loop(session, url, clip, name, model, until: float, out: list) -> None:
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            status, text = await post(session, url, clip, name, model)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            status, text = 0, type(e).__name__
        out.append((t, time.monotonic(), status, text))


async def phase(url: str, model: str, legit: bytes, bomb: bytes | None, args) -> dict:
    until = time.monotonic() + args.phase_s
    legit_out: list = []
    bomb_out: list = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as ls, aiohttp.ClientSession(timeout=timeout) as bs:
        tasks = [loop(ls, url, legit, "clip.wav", model, until, legit_out) for _ in range(args.legit_tasks)]
        if bomb is not None:
            tasks += [loop(bs, url, bomb, "bomb.flac", model, until, bomb_out) for _ in range(args.clients)]
        await asyncio.gather(*tasks)
    lat = [(b - a) * 1e3 for a, b, s, _ in legit_out if s == 200]
    answers: dict[str, int] = {}
    first: dict[str, str] = {}
    for *_, s, text in bomb_out:
        answers[str(s)] = answers.get(str(s), 0) + 1
        first.setdefault(str(s), " ".join(text.split()))
    return {"legit_sent": len(legit_out), "legit_ok": len(lat),
            "legit_success": len(lat) / len(legit_out) if legit_out else float("nan"),
            "legit_p50_ms": pct(lat, 0.5), "legit_p99_ms": pct(lat, 0.99),
            "bomb_answers": answers, "bomb_messages": first}


def run(args) -> dict:
    model = default_model(family="whisper")
    legit = make_audio(seed=1, seconds=3.0)
    bomb = bomb_flac(args.bomb_seconds, args.bomb_rate)
    limits = {r: manifest_memory_limit(os.path.join(ROOT, "docker", "k8s", "base", f"{r}.yaml"), r)
              for r in ROLES}
    print(f"bomb: {len(bomb) / 1024:.0f} KiB FLAC, {args.bomb_seconds:.0f} s at {args.bomb_rate} Hz "
          f"({args.bomb_seconds * args.bomb_rate * 4 / MIB:.0f} MiB as float32 at its own rate)", flush=True)
    with Deployment(model=model, quiet=True) as dep:
        pids = {"encoder": dep.encoders[0].proc.pid, "lm": dep.lms[0].proc.pid, "gateway": dep.gateway.proc.pid}
        t0 = time.monotonic()
        sampler = Sampler(pids, t0)
        sampler.start()
        out: dict = {"phases": {}}
        for name, b in (("baseline", None), ("bomb", bomb)):
            a = time.monotonic() - t0
            res = asyncio.run(phase(dep.url, model, legit, b, args))
            res.update(t0_s=a, t1_s=time.monotonic() - t0)
            res["peak_rss_mib"] = sampler.peak(a, res["t1_s"])
            out["phases"][name] = res
        sampler.stop.set()
        sampler.join()
        out["alive"] = {s.name: s.alive() for s in dep.services}
    out["k8s_limit_mib"] = {r: (v / MIB if v else None) for r, v in limits.items()}
    out["rss_samples"] = [(round(t, 3), {r: round(v / MIB, 1) for r, v in s.items()}) for t, s in sampler.samples]
    base = out["phases"]["baseline"]
    for res in out["phases"].values():
        res["targets"] = {"legit_success": res["legit_success"] >= 0.99,
                          **{f"{r}_rss": (lim is None or res["peak_rss_mib"][r] <= lim)
                             for r, lim in out["k8s_limit_mib"].items()}}
        res["p99_vs_baseline"] = res["legit_p99_ms"] / base["legit_p99_ms"] if base["legit_p99_ms"] else None
    return out


def table(out: dict) -> str:
    rows = ["| phase | legit ok / sent | p50 ms | p99 ms (x base) | encoder / lm / gateway peak MiB | bombs answered |",
            "|---|---|---|---|---|---|"]
    for name, r in out["phases"].items():
        peak = " / ".join(f"{r['peak_rss_mib'][k]:.0f}" for k in ROLES)
        bombs = ", ".join(f"{s}: {n}" for s, n in sorted(r["bomb_answers"].items())) or "-"
        rows.append(f"| {name} | {r['legit_ok']} / {r['legit_sent']} ({r['legit_success']:.1%}) | "
                    f"{r['legit_p50_ms']:.0f} | {r['legit_p99_ms']:.0f} ({r['p99_vs_baseline']:.1f}x) | {peak} | {bombs} |")
    lim = out["k8s_limit_mib"]
    rows.append("\nk8s limits (MiB): " + ", ".join(f"{r} {v:.0f}" for r, v in lim.items() if v))
    return "\n".join(rows)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (name, r) in enumerate(out["phases"].items()):
        ax.axvspan(r["t0_s"], r["t1_s"], color="C2" if i == 0 else "C3", alpha=0.1)
        ax.text((r["t0_s"] + r["t1_s"]) / 2, 0.97, f"{name}: legit {r['legit_success']:.0%}",
                transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8)
    ts = [t for t, _ in out["rss_samples"]]
    for j, role in enumerate(ROLES):
        ax.plot(ts, [s[role] for _, s in out["rss_samples"]], color=f"C{j}", lw=1, label=f"{role} RSS (tree)")
        lim = out["k8s_limit_mib"].get(role)
        if lim:
            ax.axhline(lim, color=f"C{j}", ls=":", lw=1, label=f"{role} k8s limit")
    ax.set_xlabel("s")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="center left")
    ax.set_title("Decoder bomb: transcriptions beside high-rate silent FLAC uploads (tiny Whisper)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--legit-tasks", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4, help="attacker tasks")
    ap.add_argument("--bomb-seconds", type=float, default=349.0)
    ap.add_argument("--bomb-rate", type=int, default=192000)
    ap.add_argument("--quick", action="store_true", help="10 s phases")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.quick:
        args.phase_s = 10.0
    out = run(args)
    print(table(out))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "setup": vars(args), **out})
    if args.plot:
        plot(out, args.plot)
    return 0 if all(out["alive"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
