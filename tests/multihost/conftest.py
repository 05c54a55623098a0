"""Fixtures of the multi-host tier: one network of namespaces per run of this package, one
deployment spread over it (shared by every scenario; the fault scenarios run
last), and plain-vLLM reference tokens computed while the engines start.

The tier skips as a whole, with the reason in pytest's summary, where network
namespaces cannot be made (not root, or a sandbox that forbids them)."""

from __future__ import annotations

import shutil
import signal

import pytest

from tests.multihost.cluster import Cluster
from tests.multihost.hosts import Network, Unavailable, check_available, sweep_stale
from tests.references import MULTIHOST, REFERENCE_REQUESTS

REQUESTS = MULTIHOST  # the scenarios' requests (tests/references.py)

# Test files in the order their scenarios must run: the shared deployment is hurt last.
ORDER = ["test_three_hosts", "test_pod", "test_headless_names", "test_faults", "test_pd_hosts", "test_nixl_hosts"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(ORDER)}
    mine = [it for it in items if "/multihost/" in str(it.fspath)]
    if mine:
        mine_sorted = sorted(mine, key=lambda it: rank.get(it.module.__name__.rsplit(".", 1)[-1], len(ORDER)))
        idx = [i for i, it in enumerate(items) if "/multihost/" in str(it.fspath)]
        for i, it in zip(idx, mine_sorted):
            items[i] = it


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def network():
    try:
        check_available()
    except Unavailable as e:
        pytest.skip(f"multi-host tests need network namespaces: {e}")
    sweep_stale()
    net = Network()
    # SIGTERM (a CI job cancelled, `timeout`) ends the run as Ctrl-C does, so the finalizers below
    # still delete the namespaces and kill what runs in them; after SIGKILL the next run's
    # sweep_stale() does it.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        net.start()
        yield net
    finally:
        net.close()
        signal.signal(signal.SIGTERM, previous)


class _Reference:
    """The session's plain-vLLM tokens (``tests/conftest.py``'s ``reference_run``), waited for only when
    a scenario asks: the run goes on while the cluster starts."""

    def __init__(self, run) -> None:
        self._run = run

    def __getitem__(self, name: str) -> list[int]:
        return dict(zip(REFERENCE_REQUESTS, self._run.result(timeout=600)))[name]


@pytest.fixture(scope="package")
def mh_reference(reference_run):
    return _Reference(reference_run)


@pytest.fixture(scope="package")
def cluster(request, tiny_model, network, mh_reference):
    failed, started = request.session.testsfailed, False
    c = Cluster(network, tiny_model)
    try:
        c.start()
        started = True
        yield c
    finally:
        c.stop()
        if started and request.session.testsfailed == failed:  # kept after a failure: the services' logs
            shutil.rmtree(c.log_dir, ignore_errors=True)  # it holds the CA key and the token
