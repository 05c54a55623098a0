"""Issue 3 must-show: kill -9 the encoder with items outstanding, start it
again: no segment of the dead process remains, the LM stays up, the affected
requests fail cleanly (no hang), and the next request is exact again."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.up import Deployment, grpc_serving
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import image_chat, post

pytestmark = pytest.mark.e2e


def _segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("epd-") and f"-{pid}-" in n}


def test_kill_9_encoder_mid_flight_then_restart(tiny_model, reference):
    with Deployment(model=tiny_model, quiet=True) as dep:
        import psutil

        engine_pids = [p.pid for p in psutil.Process(dep.encoder.proc.pid).children(recursive=True)]
        owned = set().union(*(_segments_of(pid) for pid in engine_pids))
        assert owned, "the encoder's engine owns an outbound segment"

        bodies = [image_chat(500 + i, max_tokens=16, size=(224, 224)) for i in range(6)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(post, dep.url + "/v1/chat/completions", b, 60) for b in bodies]
            time.sleep(0.3)
            os.killpg(dep.encoder.proc.pid, signal.SIGKILL)  # service and engine processes, no cleanup
            t0 = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        elapsed = time.monotonic() - t0
        assert elapsed < 30, elapsed  # no hang: every request ended
        for status, body in results:
            assert status == 200 or (status >= 500 and body["error"]["message"]), (status, body)
        assert grpc_serving(dep.lm_addr, security=dep.client_security), "the LM stays up"

        dep.encoder.proc.wait()
        dep.encoder.start(dict(os.environ))
        deadline = time.monotonic() + 240
        while not grpc_serving(dep.encoder_addr, security=dep.client_security):
            assert dep.encoder.alive() and time.monotonic() < deadline, dep.encoder.log_tail()
            time.sleep(0.5)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in owned), "dead encoder's segments were removed"

        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference["image0"]
