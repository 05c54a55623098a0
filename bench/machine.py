"""What every benchmark records about the machine it ran on (one place)."""

from __future__ import annotations

import datetime
import os
import platform


def machine_info() -> dict:
    """CPU model, usable cores, Python, platform and the UTC time of the run."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
