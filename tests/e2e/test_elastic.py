"""An elastic fleet under load, one ``epd up``-style deployment for the module (1 encoder + 1 LM): while
three clients send image and text chats through the gateway, one encoder and one LM join
(``Deployment.add_encoder``/``add_lm``: the gateway learns of them from its fleet file) and the first
encoder and LM leave (``Deployment.remove``: SIGTERM, the instance drains, then exits). No request fails,
every answer is plain vLLM's, each leaver drained (it exited by itself, having said so), left nothing in
/dev/shm and nothing outstanding at the gateway, and each joiner was routed requests."""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from services.up import Deployment
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import metric, post, settled

# A deployment of its own and four engine starts: minutes on 2 cores, so in the slow tier (make test-all).
# Every e2e deployment's stop still runs the drain path (SIGTERM, NOT_SERVING, stop once idle).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _with_text(images: list[str]) -> list[str]:
    """``images`` with a text chat after each: every other request carries an image."""
    return [n for pair in itertools.zip_longest(images, ["text", "tconv_0"] * (len(images) // 2 + 1)) for n in pair
            if n][:2 * len(images)]


# Images other tests also send (their references are the session's). Before the joiners: the burst test's
# 12. After: 40 images the multi-host tests send, each new here: an image an encoder holds goes back to it
# (--encoder-routing held), so only images nobody holds show that a joined encoder is routed to.
BEFORE = _with_text([f"burst{i}" for i in range(12)])
AFTER = _with_text([f"fault{i}" for i in range(24)] + [f"dns{i}" for i in range(16)])
CLIENTS = 3
THINK_S = 0.3
"""Each client's pause between its answer and its next request: a steady load that leaves the joiners' engine
starts some CPU on a 2-core host (a saturating one stretched an LM's start past ten minutes there)."""


class Load:
    """``CLIENTS`` threads sending ``NAMES`` in turn until ``stop``; every answer kept, in order."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[str, int, dict]] = []
        self.names = BEFORE
        """What the clients send, in turn (the test switches it to ``AFTER`` once the joiners serve)."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), name=f"load{k}", daemon=True)
                         for k in range(CLIENTS)]

    def _client(self, k: int) -> None:
        for i in itertools.count(k):
            if self._stop.is_set():
                return
            names = self.names
            name = names[i % len(names)]
            try:
                status, body = post(self.url + "/v1/chat/completions", REFERENCE_REQUESTS[name], timeout=300)
            except OSError as e:  # refused or reset: a lost request, counted as one
                status, body = 0, {"error": repr(e)}
            self.answers.append((name, status, body))
            self._stop.wait(THINK_S)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def wait_for(self, n: int, timeout: float = 300.0) -> None:
        """Until ``n`` more answers than now have come back."""
        want = len(self.answers) + n
        deadline = time.monotonic() + timeout
        while len(self.answers) < want:
            assert time.monotonic() < deadline, f"{len(self.answers)} answers, waiting for {want}"
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(330)


def _pids(svc) -> set[int]:
    root = psutil.Process(svc.proc.pid)
    return {root.pid, *(p.pid for p in root.children(recursive=True))}


def _segments_of(pids: set[int]) -> list[str]:
    """This host's epd shared-memory segments owned by one of ``pids`` (``epd-<role>-<pid>-<hex>``)."""
    owned = re.compile(r"^epd-[a-z]+-(\d+)-[0-9a-f]+$")
    return [n for n in os.listdir("/dev/shm") if (m := owned.fullmatch(n)) and int(m[1]) in pids]


def _calls(dep: Deployment, role: str, address: str) -> float:
    return metric(dep.gateway_metrics, "epd_gateway_instance_calls_total", role=role, instance=address)


def _outstanding(dep: Deployment, address: str = "") -> float:
    labels = {"instance": address} if address else {}
    return metric(dep.gateway_metrics, "epd_gateway_instance_outstanding", **labels)


@pytest.mark.timeout(1800)  # four engine starts and two drains on a busy 2-core host: minutes each, worst case
def test_an_encoder_and_an_lm_join_and_leave_under_load_without_losing_a_request(tiny_model, reference_run):
    dep = Deployment(model=tiny_model, quiet=True, drain_grace_s=90).start(timeout=900)  # a busy 2-core host
    load = None
    try:
        load = Load(dep.url).start()
        load.wait_for(3)
        first_encoder, first_lm = dep.encoder, dep.lm

        with ThreadPoolExecutor(2) as pool:  # both start at once; each returns once the gateway admitted it
            adding = pool.submit(dep.add_encoder, 900), pool.submit(dep.add_lm, 900)
            joined_encoder, joined_lm = (f.result() for f in adding)
        load.names = AFTER
        # Routed to under the load: each joiner receives calls from the gateway.
        assert settled(lambda: _calls(dep, "encoder", joined_encoder.address) > 0, True, 300), "no Encode"
        assert settled(lambda: _calls(dep, "lm", joined_lm.address) > 0, True, 300), "no Generate"

        for leaver, role in ((first_encoder, "encoder"), (first_lm, "lm")):
            load.wait_for(2)
            pids = _pids(leaver)
            assert dep.remove(leaver), f"{leaver.name} did not drain in time:\n{leaver.log_tail()}"
            assert re.search(rf"{role} drained in", leaver.log_tail(200)), leaver.log_tail()
            assert _segments_of(pids) == [], "the leaver's shared memory is gone with it"
            assert _outstanding(dep, leaver.address) == 0.0  # nothing of it in flight at the gateway
        assert [e.address for e in dep.encoders] == [joined_encoder.address]
        assert [lm.address for lm in dep.lms] == [joined_lm.address]

        load.wait_for(6)  # served by the joiners alone
    finally:
        if load is not None:
            load.stop()
        try:
            if load is not None:
                assert settled(lambda: _outstanding(dep), 0.0, 60) == 0.0, "the gateway holds no call"
        finally:
            dep.stop()

    reference = dict(zip(REFERENCE_REQUESTS, reference_run.result()))  # plain vLLM's, run beside all this
    failed = [(name, status, body) for name, status, body in load.answers if status != 200]
    assert not failed, failed[:3]
    wrong = [name for name, _, body in load.answers if body["choices"][0]["token_ids"] != reference[name]]
    assert not wrong, wrong
    assert {n for n, _, _ in load.answers} & {"text", "tconv_0"} and len(load.answers) >= 11
