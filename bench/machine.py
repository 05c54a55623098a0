"""What every benchmark shares (one place): the machine and code it ran on,
and percentiles."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_info() -> dict:
    """CPU model, usable cores, Python, platform, the UTC time of the run, and
    the git commit measured (with any uncommitted files of the measured code)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    isa = []
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
        # What decides CPU inference speed here (bf16 matmuls): capacity differs several-fold between
        # hosts of one machine kind with and without these.
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "isa": isa, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  env=dict(os.environ)).stdout  # explicit: services/common/spawn.py

        info["git_commit"] = git("rev-parse", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "ectransfer", "services", "protos", "bench")
        info["git_dirty"] = [line for line in dirty.splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``; NaN when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")
