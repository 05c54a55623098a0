"""Fixtures of the multi-host tier: one network of namespaces per run of this package, one
deployment spread over it (shared by every scenario; the fault scenarios run
last), and plain-vLLM reference tokens computed while the engines start.

The tier skips as a whole, with the reason in pytest's summary, where network
namespaces cannot be made (not root, or a sandbox that forbids them)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from services.common.spawn import child_env
from tests.e2e.helpers import image_chat
from tests.multihost.cluster import Cluster
from tests.multihost.hosts import Network, Unavailable, check_available, sweep_stale

# Every request whose tokens a scenario compares with plain vLLM. Each scenario uses images no
# other one sends (a seen image may be reused from an LM's encoder cache, with no transfer).
REQUESTS = {
    "three": image_chat(700, max_tokens=8),
    "pod": image_chat(701, max_tokens=8),
    **{f"dns{i}": image_chat(710 + i, max_tokens=8) for i in range(16)},
    **{f"fault{i}": image_chat(750 + i, max_tokens=8) for i in range(24)},
    "pd": image_chat(790, max_tokens=8),
}

# Test files in the order their scenarios must run: the shared deployment is hurt last.
ORDER = ["test_three_hosts", "test_pod", "test_headless_names", "test_faults", "test_pd_hosts"]


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
    """Reference tokens computed in the background: a plain vLLM subprocess (``tools.reference``,
    in its own session) whose output a thread collects; ``close()`` kills it if it still runs."""

    def __init__(self, model: str) -> None:
        self._names = list(REQUESTS)
        self._result: dict | BaseException | None = None
        self._proc = subprocess.Popen([sys.executable, "-m", "tools.reference", "--model", model],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True, env=child_env())
        self._thread = threading.Thread(target=self._run, name="mh-reference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            out, err = self._proc.communicate(json.dumps([REQUESTS[n] for n in self._names]))
            if self._proc.returncode != 0:
                raise RuntimeError(f"reference run failed ({self._proc.returncode}):\n{err[-3000:]}")
            self._result = dict(zip(self._names, json.loads(out.strip().splitlines()[-1])))
        except BaseException as e:  # noqa: BLE001 - raised in the test that asks
            self._result = e

    def __getitem__(self, name: str) -> list[int]:
        self._thread.join(600)
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None, "the reference run did not finish"
        return self._result[name]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._thread.join(30)


@pytest.fixture(scope="package")
def mh_reference(tiny_model, network):
    ref = _Reference(tiny_model)
    try:
        yield ref
    finally:
        ref.close()


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
