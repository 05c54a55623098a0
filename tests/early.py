"""The e2e tier's shared work, started when collection ends, at a lower CPU priority, while the unit and
integration tiers run first (tests/conftest.py orders the tiers).

Those tiers run in this one process and mostly on one core, and they wait on sockets and deadlines; the
other core idles. The e2e tier's shared work is CPU: the session deployment (two vLLM engines with their
workers in processes of their own, five vLLM imports at about 8 s of CPU each), plain vLLM's reference
runs (the tiny model's, then each selected family's) and the parity module's ``vllm serve``. Started at
nice 10 (``NICE``) it takes the idle core and yields a busy one to the tests in front of it: on Linux a
thread's nice value is its own (setpriority(2), "BUGS"), and the processes it spawns inherit it.

Every process started here gets ``SESSION_ENV``, this process's environment taken before any test ran: a
unit test that sets a variable for itself (``VLLM_API_KEY``, say) with ``monkeypatch`` while a service
starts here must not configure that service.

Who owns what: ``start`` launches; a fixture takes each piece (``deployment``, ``reference_run``, the
families' references, ``vllm_serve``) and stops what it took; ``finish`` (the session's end) stops what no
fixture took (a run cut short by ``-x``, a selection that did not use it)."""

from __future__ import annotations

import os
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

NICE = 10
SESSION_ENV: dict[str, str] = {}
"""The environment every process started here gets (``snapshot_env``, from tests/conftest.py at import)."""

_pools: list[ThreadPoolExecutor] = []
_deployment: Future | None = None
_deployment_taken = False
_reference: Future | None = None


def snapshot_env() -> None:
    from services.common.spawn import child_env

    SESSION_ENV.clear()
    SESSION_ENV.update(child_env())


def _lower_priority() -> None:
    """Runs on each of this module's threads, before any job (Linux: this thread alone)."""
    os.setpriority(os.PRIO_PROCESS, 0, NICE)


def _pool(name: str) -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"early-{name}", initializer=_lower_priority)
    _pools.append(pool)
    return pool


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
        from tests.e2e.conftest import start_session_deployment

        _deployment = _pool("deployment").submit(start_session_deployment, tiny, SESSION_ENV)
    # One thread for the reference runs and then vllm serve: one vLLM engine at a time beside the deployment.
    refs = _pool("references")
    if _uses(items, "reference_run") or _uses(items, "reference"):
        from tests.references import REFERENCE_REQUESTS
        from tools.reference import run_subprocess

        _reference = refs.submit(run_subprocess, tiny, list(REFERENCE_REQUESTS.values()), env=SESSION_ENV)
    if _selected(e2e, ".test_families"):
        from tests.e2e import test_families

        test_families.start_references(_families(e2e), pool=refs, env=SESSION_ENV)
    if _selected(e2e, ".test_openai_parity"):
        from tests.e2e import test_openai_parity

        log_dir = tempfile.mkdtemp(prefix="vllm-serve-")  # under the run's directory (tests/conftest.py)
        refs.submit(test_openai_parity.start_early, tiny, log_dir, SESSION_ENV)


def session_deployment():
    """The session deployment started here (waits for it), or None when ``start`` did not start one."""
    global _deployment_taken
    if _deployment is None:
        return None
    _deployment_taken = True
    return _deployment.result()


def reference_run() -> Future | None:
    return _reference


def finish() -> None:
    """Stops what no fixture took; the pools' threads end with their jobs."""
    for pool in _pools:
        pool.shutdown(wait=False, cancel_futures=True)
    if _deployment is not None and not _deployment_taken:
        try:
            _deployment.result(timeout=600).stop()
        except Exception:  # noqa: BLE001 - it failed to start: its own start stopped what it had started
            pass
    families, parity = (sys.modules.get(f"tests.e2e.{m}") for m in ("test_families", "test_openai_parity"))
    if families is not None:
        families.stop_references()
    if parity is not None:
        parity.stop_early()
