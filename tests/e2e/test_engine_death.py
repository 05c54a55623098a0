"""Processes dying under a running deployment, one deployment for the module, in this order:

1. (issue 3) kill -9 the encoder with items outstanding, start it again: no segment of the dead
   process remains, the LM stays up, the affected requests fail cleanly (no hang), and the next
   request is exact again;
2. a service whose vLLM engine dies stops serving: kill -9 the EngineCore process of the LM, then of
   the encoder; each turns NOT_SERVING within seconds and exits non-zero (so Docker or Kubernetes
   restarts it), and the gateway answers a server error for the dead LM instead of hanging. These
   end the deployment, so they come last."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from services.up import Deployment, grpc_serving
from tests.e2e.conftest import REFERENCE_REQUESTS, stop_in_background
from tests.e2e.helpers import image_chat, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dep(tiny_model):
    d = Deployment(model=tiny_model, quiet=True).start()
    yield d
    stop_in_background(d)


def _engine_core(svc) -> int:
    """The pid of the service's EngineCore process (vLLM names it in its title)."""
    for p in psutil.Process(svc.proc.pid).children(recursive=True):
        try:
            title = " ".join([p.name(), *p.cmdline()])
        except psutil.NoSuchProcess:
            continue
        if "EngineCore" in title:
            return p.pid
    raise AssertionError(f"no EngineCore process under {svc.name}: "
                         f"{[(p.pid, p.name()) for p in psutil.Process(svc.proc.pid).children(recursive=True)]}")


def _not_serving_within(dep, svc, seconds: float) -> float:
    t0 = time.monotonic()
    while grpc_serving(svc.address, security=dep.client_security):
        assert time.monotonic() - t0 < seconds, f"{svc.name} still SERVING {seconds}s after its engine died"
        time.sleep(0.1)
    return time.monotonic() - t0


def _segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("epd-") and f"-{pid}-" in n}


def test_kill_9_encoder_mid_flight_then_restart(dep, reference):
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


def test_a_killed_lm_engine_turns_the_lm_not_serving_and_it_exits_non_zero(dep):
    status, body = post(dep.url + "/v1/chat/completions", image_chat(0), timeout=120)
    assert status == 200, body
    os.kill(_engine_core(dep.lm), signal.SIGKILL)
    _not_serving_within(dep, dep.lm, 30)
    assert dep.lm.proc.wait(30) != 0, dep.lm.log_tail()
    status, body = post(dep.url + "/v1/chat/completions", image_chat(1), timeout=60)
    assert status >= 500, (status, body)  # a clear error, not a hang


def test_a_killed_encoder_engine_turns_the_encoder_not_serving_and_it_exits_non_zero(dep):
    assert grpc_serving(dep.encoder_addr, security=dep.client_security)
    os.kill(_engine_core(dep.encoder), signal.SIGKILL)
    _not_serving_within(dep, dep.encoder, 30)
    assert dep.encoder.proc.wait(30) != 0, dep.encoder.log_tail()
    assert "engine" in dep.encoder.log_tail(60).lower()
