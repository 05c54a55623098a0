"""One epd-serve deployment (encoder + LM + gateway as subprocesses) per test
session (plain vLLM's reference tokens: ``tests/conftest.py``'s ``reference``).

The session's deployment runs with mutual TLS and the auth token on every
internal link (gateway -> encoder, gateway -> LM, LM -> encoder Transfer, the
control lane's session secret), with certificates it makes itself; the other
deployments of the suite use ``epd up``'s default, the token alone. Its LM carries the test-only
perturbation hook (tests/e2e/perturb), switched off except inside test_perturbation."""

from __future__ import annotations

import threading

import psutil
import pytest

from services.up import Deployment
from tests import early
from tests.conftest import MULTIPROCESS_ENGINES
from tests.e2e.helpers import TEARDOWN_DRAIN_S, perturbable
from tests.references import REFERENCE_REQUESTS  # noqa: F401 - the e2e tests import it from here

_stopping: list[threading.Thread] = []


def stop_in_background(dep: Deployment) -> None:
    """Stops ``dep`` (its orderly stop: SIGTERM, each service stops its own engine) on a thread, so the
    next test's deployment starts while this one's engines wind down (vLLM's shutdown waits seconds on
    its worker and engine processes, mostly idle). Every deployment has its own ports and log
    directory; the session's end waits for every stop (``_background_stops``)."""
    thread = threading.Thread(target=dep.stop, name=f"stop {dep.log_dir}", daemon=True)
    thread.start()
    _stopping.append(thread)


@pytest.fixture(scope="session", autouse=True)
def _background_stops():
    yield
    for thread in _stopping:
        thread.join(60)


def session_deployment(model: str) -> Deployment:
    """The session's deployment, not started (tests/early.py launches it at the session's start). vLLM's
    front-end flags for tool calls, as tests/e2e/test_openai_parity.py gives `vllm serve`. vLLM's default
    engine processes on CPU (``--executor mp``: the worker in its own process, as `vllm serve` runs it), kept
    covered here: the services' own default on CPU, and every other deployment's, is one process
    (``--executor auto``, services/common/engine.py)."""
    return perturbable(Deployment(model=model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, security="tls", env=dict(MULTIPROCESS_ENGINES),
                                  encoder_args=["--executor", "mp"],
                                  lm_args=["--executor", "mp", "--enable-auto-tool-choice", "--tool-call-parser",
                                           "hermes"]))


@pytest.fixture(scope="session")
def deployment(tiny_model, reference_run):
    """The session's deployment. Its stop, the one `epd up` makes on Ctrl-C, leaves no process behind: with
    vLLM's default engine processes (a worker under each engine) this is where that is checked
    (tests/e2e/test_lifecycle.py checks `epd up` itself with one-process engines)."""
    dep = early.session_deployment() or session_deployment(tiny_model).start()
    yield dep
    tree = [p for svc in dep.services if svc.proc is not None
            for p in _tree(svc.proc.pid)]
    assert any("EngineCore" in _title(p) for p in tree), "vLLM's engine processes are there to check"
    dep.stop()
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [(p.pid, _title(p)) for p in alive]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _title(p: psutil.Process) -> str:
    try:
        return " ".join([p.name(), *p.cmdline()])
    except psutil.Error:
        return "?"


@pytest.fixture
def client(deployment):
    from openai import OpenAI

    return OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=120)
