"""Spawning while another thread changes the environment: the EFAULT race of a vfork'ed child that
execs with the global ``environ`` (services/common/spawn.py), and that an explicit environment (what the
project passes) or fork instead of vfork avoids it."""

from __future__ import annotations

import errno
import json
import pathlib
import subprocess
import sys

import pytest

from services.common.spawn import child_env

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs in its own interpreter so the churn cannot touch pytest's environment. One thread adds and removes
# variables (each new name reallocates glibc's environ array and frees the old one) while the main thread
# spawns /bin/true the chosen way; prints how many spawns failed and with which errno.
CHURN = r"""
import json, os, subprocess, sys, threading, time
from services.common.spawn import child_env
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "no-vfork":
    subprocess._USE_VFORK = False
stop = threading.Event()
def churn():
    i = 0
    while not stop.is_set():
        names = [f"EPD_CHURN_{i}_{j}" for j in range(64)]
        for name in names:
            os.environ[name] = "x" * 4096
        for name in names:
            del os.environ[name]
        i += 1
        time.sleep(0)  # lets the spawning thread have the GIL between rounds
threading.Thread(target=churn, daemon=True).start()
errors = []
for _ in range(n):
    try:
        subprocess.run(["/bin/true"], env=child_env() if mode == "child_env" else None, check=True)
    except OSError as e:
        errors.append(e.errno)
stop.set()
print(json.dumps(errors))
"""


def spawn_under_churn(mode: str, n: int) -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode, str(n)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPython uses vfork on Linux only")
def test_inherited_spawns_fail_with_efault_while_another_thread_changes_the_environment():
    """The reproduction: ``env=None`` with vfork, under the churn (about half of them failed on a 2-core
    host, 2026-11-28)."""
    errors = spawn_under_churn("inherit", 300)
    assert errors and set(errors) == {errno.EFAULT}, errors


@pytest.mark.parametrize(("mode", "n"), [("child_env", 300), ("no-vfork", 100)])
def test_spawns_never_fail_while_another_thread_changes_the_environment(mode, n):
    """With an explicit copy of the environment (every spawn of the project's), or with fork, none may.
    (A fork copies the whole test process, 0.1-0.4 s here: 100 of them, where about half of the inherited
    vfork spawns fail.)"""
    assert spawn_under_churn(mode, n) == []
