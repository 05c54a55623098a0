"""The e2e tier's shared work, launched when collection ends, at a lower CPU priority, while the unit and
integration tiers run first (tests/conftest.py orders the tiers).

Those tiers run in this one process and mostly on one core, and they wait on sockets and deadlines; the
other core idles. The e2e tier's shared work is CPU in other processes: the session deployment (two vLLM
engines with their workers in processes of their own, five vLLM imports at about 8 s of CPU each), plain
vLLM's reference runs (the tiny model's and each selected family's) and the parity module's ``vllm
serve``. Launched under ``nice -n 19`` they take the idle core and yield a busy one to the tests in front
of them (their own children, vLLM's engine and worker processes, inherit the nice value). At nice 10 a
unit test that starts a vLLM process of its own (``test_engine_env``) took 27-30 s instead of 9.

Only processes are started here, all on the main thread before any test runs; nothing of it runs on a
thread of this process while tests run. (A first version waited for them on background threads: a unit
test that replaced ``socket.create_connection`` for itself then broke the deployment's readiness check.)
Each piece is waited for by the fixture that takes it.

Who owns what: ``start`` launches; a fixture takes each piece (``deployment``, ``reference_run``, the
families' references, ``vllm_serve``) and stops what it took; ``finish`` (the session's end) stops what no
fixture took (a run cut short by ``-x``, a selection that did not use it)."""

from __future__ import annotations

import os
import sys
import tempfile

NICE = ("nice", "-n", "19")
AUTOGROUP_NICE = 19


def background(pid: int) -> None:
    """``pid``, which leads a session of its own (the services and `vllm serve` start one: their stop
    kills the group), at the lowest CPU priority against the tests. Its ``nice`` alone (``NICE``) does not
    do it where the kernel schedules by autogroup (Linux's default on desktops and most distribution
    kernels, and on this host): each session's processes share the CPU as one group against every other
    session, whatever their nice values. So the session's group is niced too (``/proc/PID/autogroup``;
    a kernel without it: nothing to do)."""
    _autogroup(pid, AUTOGROUP_NICE)


def foreground(procs) -> None:
    """``procs`` (psutil processes) back at this process's own priority: each one's nice and its session's
    group (lowering either needs root; without it they stay where they were)."""
    import psutil

    own = os.nice(0)
    for p in procs:
        try:
            p.nice(own)
        except psutil.Error:
            pass
        _autogroup(p.pid, own)


def _autogroup(pid: int, nice: int) -> None:
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup, the process gone, or not allowed
        pass

_deployment = None  # services.up.Deployment, launched
_deployment_taken = False
_reference = None  # tools.reference.Run


def _selected(items, module: str) -> bool:
    return any(getattr(item, "module", None) is not None and item.module.__name__.endswith(module) for item in items)


def _families(items) -> set[str]:
    """The families test_families' selected tests run (its slow ones are left out of the default run)."""
    return {item.callspec.params["family"] for item in items
            if getattr(item, "module", None) is not None and item.module.__name__.endswith(".test_families")
            and "family" in getattr(getattr(item, "callspec", None), "params", {})}


def _uses(items, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in items)


def start(items) -> None:
    """Launches what the selected e2e tests share; a no-op when none is selected."""
    global _deployment, _reference
    e2e = [item for item in items if ".e2e." in getattr(getattr(item, "module", None), "__name__", "")]
    if not e2e:
        return
    from services.cli import default_model

    tiny = default_model()
    if _uses(e2e, "deployment"):
        from tests.e2e.conftest import session_deployment

        _deployment = session_deployment(tiny)
        for svc in _deployment.services:
            svc.command = [*NICE, *svc.argv]
        _deployment.launch()
        for svc in _deployment.services:
            background(svc.proc.pid)
    if _uses(items, "reference_run"):
        from tests.references import REFERENCE_REQUESTS
        from tools.reference import launch

        _reference = launch(tiny, list(REFERENCE_REQUESTS.values()), prefix=NICE)
    if _selected(e2e, ".test_families"):
        from tests.e2e import test_families

        test_families.start_references(_families(e2e), prefix=NICE)
    if _selected(e2e, ".test_openai_parity"):
        from tests.e2e import test_openai_parity

        log_dir = tempfile.mkdtemp(prefix="vllm-serve-")  # under the run's directory (tests/conftest.py)
        test_openai_parity.start_early(tiny, log_dir, prefix=NICE)


def session_deployment():
    """The session deployment launched here, once ready (None when ``start`` did not launch one)."""
    global _deployment_taken
    if _deployment is None:
        return None
    _deployment_taken = True
    from tests.ahead import renice

    _deployment.wait_ready()
    renice(_deployment)  # the tests in front now; what runs ahead of them stays at 19 (tests/ahead.py)
    return _deployment


def reference_run():
    return _reference


def finish() -> None:
    """Stops what no fixture took."""
    if _deployment is not None and not _deployment_taken:
        _deployment.stop()
    if _reference is not None:
        _reference.stop()  # a no-op once it has exited
    families, parity = (sys.modules.get(f"tests.e2e.{m}") for m in ("test_families", "test_openai_parity"))
    if families is not None:
        families.stop_references()
    if parity is not None:
        parity.stop_early()
