"""One epd-serve deployment (encoder + LM + gateway as subprocesses) per test
session (plain vLLM's reference tokens: ``tests/conftest.py``'s ``reference``).

The session's deployment runs with mutual TLS and the auth token on every
internal link (gateway -> encoder, gateway -> LM, LM -> encoder Transfer, the
control lane's session secret), with certificates it makes itself; the other
deployments of the suite use ``epd up``'s default, the token alone. Its LM carries the test-only
perturbation hook (tests/e2e/perturb), switched off except inside test_perturbation."""

from __future__ import annotations

import threading

import pytest

from services.up import Deployment
from tests.conftest import MULTIPROCESS_ENGINES
from tests.e2e.helpers import start_perturbable
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


def _selected(request, module: str) -> bool:
    return any(getattr(item, "module", None) is not None and item.module.__name__.endswith(module)
               for item in request.session.items)


def _selected_families(request) -> set[str]:
    """The families test_families' selected tests run (its slow ones are left out of the default run)."""
    return {item.callspec.params["family"] for item in request.session.items
            if getattr(item, "module", None) is not None and item.module.__name__.endswith(".test_families")
            and "family" in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.fixture(scope="session", autouse=True)
def _background_starts(request, tiny_model, tmp_path_factory):
    """Work that would otherwise wait for its module, started with the session on one background
    thread (the suite spends much of its time waiting on the network): the families' plain-vLLM
    reference runs (``test_families.start_references``), then the parity module's ``vllm serve``
    (``test_openai_parity.start_early``), each only when its module is selected."""
    families = _selected(request, ".test_families")
    parity = _selected(request, ".test_openai_parity")
    if families:
        from tests.e2e import test_families

        test_families.start_references(_selected_families(request))
    if parity:
        from tests.e2e import test_openai_parity

        log_dir = str(tmp_path_factory.mktemp("vllm-serve"))
        if families:  # after the references: the server then idles rather than competes with them
            test_families.after_references(lambda: test_openai_parity.start_early(tiny_model, log_dir))
        else:
            test_openai_parity.start_early(tiny_model, log_dir)
    yield
    if families:
        test_families.stop_references()
    if parity:
        test_openai_parity.stop_early()


@pytest.fixture(scope="session")
def deployment(tiny_model, reference_run):
    # vLLM's front-end flags for tool calls, as tests/e2e/test_openai_parity.py gives `vllm serve`.
    # vLLM's default engine processes (the worker in its own process), as production runs them: most
    # other deployments run one-process engines to save time (tests/conftest.py)
    dep = Deployment(model=tiny_model, quiet=True, security="tls", env=MULTIPROCESS_ENGINES,
                     lm_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    start_perturbable(dep)  # the perturbation hook, off until test_perturbation turns it on
    yield dep
    dep.stop()


@pytest.fixture
def client(deployment):
    from openai import OpenAI

    return OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=120)
