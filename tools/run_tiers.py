"""``make test``: the default pytest run as two tiers side by side.

One pytest process runs ``tests/e2e`` (the services as subprocesses), the
other everything else (unit, integration, multihost, gpu). A run spends much of
its time waiting on engine starts and orderly stops, so two tiers on two cores
finish well before one process running both. Each tier draws service ports from
its own ``EPD_PORT_RANGE`` (``services.up.free_port``), so the two can never
pick the same free port between the check and the bind.

The e2e tier's output streams live; the other tier's is written to
``.pytest-tiers/<tier>.log`` and printed when it ends. The exit status is
non-zero if either tier failed. Extra arguments go to both pytest processes.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Disjoint, below Linux's default ephemeral range (32768-60999).
TIERS = (
    ("e2e", ["tests/e2e"], "20000-25999"),
    ("library", ["tests", "--ignore=tests/e2e"], "26000-31999"),
)


def main(argv: list[str]) -> int:
    logs = ROOT / ".pytest-tiers"
    logs.mkdir(exist_ok=True)
    procs = []
    for i, (name, paths, ports) in enumerate(TIERS):
        env = dict(os.environ, EPD_PORT_RANGE=ports)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *paths, *argv]
        out = None if i == 0 else open(logs / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), out,
                      time.monotonic()))

    def forward(signum, _frame):
        for _, p, _, _ in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    ended: dict[str, float] = {}
    while len(ended) < len(procs):  # each tier's own wall time
        for name, p, _, t0 in procs:
            if name not in ended and p.poll() is not None:
                ended[name] = time.monotonic() - t0
        time.sleep(0.5)
    results = []
    for name, p, out, _ in procs:
        rc = p.wait()
        results.append((name, rc, ended[name]))
        if out is not None:
            out.close()
            print(f"\n========== tier {name} (tests {' '.join(TIERS[[t[0] for t in TIERS].index(name)][1])}) ==========",
                  flush=True)
            sys.stdout.write((logs / f"{name}.log").read_text())
    print("\n" + "  ".join(f"tier {n}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {s:.0f} s"
                           for n, rc, s in results), flush=True)
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
