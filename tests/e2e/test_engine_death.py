"""A service whose vLLM engine dies stops serving: kill -9 the EngineCore
process of a running LM, then of a running encoder; each turns NOT_SERVING
within seconds and exits non-zero (so Docker or Kubernetes restarts it), and
the gateway answers a server error for the dead LM instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.up import Deployment, grpc_serving
from tests.e2e.helpers import image_chat, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dep(tiny_model):
    with Deployment(model=tiny_model, quiet=True) as d:
        yield d


def _engine_core(svc) -> int:
    """The pid of the service's EngineCore process (vLLM names it in its title)."""
    import psutil

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
