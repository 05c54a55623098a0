"""Processes starting together and dying under a running deployment, one deployment for the module,
in this order:

0. the encoder, the LM and the gateway started at the same moment, none waiting for another: the
   gateway listens at once and answers 503 with the reason while the engines load, admits them as
   they become ready, and the first request it takes is exact;
1. (issue 3) kill -9 the encoder with items outstanding, start it again: no segment of the dead
   process remains, the LM stays up, the affected requests fail cleanly (no hang), and the next
   request is exact again;
2. kill -9 the LM service alone (not its process group): within the engine lifeline's bound nothing
   of it runs (its EngineCore, Python's resource tracker) and nothing it owned is left in /dev/shm;
   the LM starts again for the tests after;
3. a service whose vLLM engine dies stops serving: kill -9 the EngineCore process of the LM, then of
   the encoder; each turns NOT_SERVING within seconds and exits non-zero (so Docker or Kubernetes
   restarts it), and the gateway answers a server error for the dead LM instead of hanging. These
   end the deployment, so they come last."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from ectransfer.connector.lifeline import BOUND_S
from services.up import Deployment, grpc_serving, wait_ready
from tests.e2e.conftest import REFERENCE_REQUESTS, stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, image_chat, metric, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dep(tiny_model):
    """Every service started at the same moment (the start-order test checks what that looks like);
    the tests after it wait until the deployment serves (``_serving``)."""
    d = Deployment(model=tiny_model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S)
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for svc in [d.gateway, *d.lms, *d.encoders]:  # all at once; none waits for another
            svc.start(env)
        yield d
    finally:
        stop_in_background(d)


@pytest.fixture
def serving(dep):
    """``dep`` once the gateway has admitted its LM and encoder (at once after the start-order test)."""
    wait_ready({dep.gateway: lambda: _admitted(dep)}, time.monotonic() + 300, poll_s=0.2)
    return dep


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


NOT_READY = "no LM is ready yet"


def _get(url: str) -> tuple[int, dict]:
    """Status and JSON body; (0, {}) while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def _admitted(dep: Deployment) -> bool:
    """/health is 200 and lists the LM and the encoder as admitted."""
    status, health = _get(dep.url + "/health")
    return (status == 200 and health.get("lms", {}).get(dep.lm_addr) is True
            and health.get("encoders", {}).get(dep.encoder_addr) is True)


def test_services_started_together_serve_the_first_request_exactly_once_the_lm_is_admitted(dep, reference):
    """The fixture started the gateway, the LM and the encoder at the same moment, none waiting for
    another: the gateway listens at once and answers 503 with the reason while the engines load,
    admits them as they become ready, and the first request it takes is exact."""
    deadline = time.monotonic() + 300
    # A generous timeout: an LM that is serving but slow to answer on a loaded host must not read as
    # "still loading" below (its answers would not be the 503s asserted there).
    lm_serving = functools.partial(grpc_serving, dep.lm_addr, timeout=30, security=dep.client_security)
    enc_serving = functools.partial(grpc_serving, dep.encoder_addr, timeout=30, security=dep.client_security)
    # The gateway listens long before an engine is loaded, and says what it waits for.
    wait_ready({dep.gateway: lambda: _get(dep.url + "/health")[0] in (200, 503)}, deadline, poll_s=0.2)
    status, health = _get(dep.url + "/health")
    chat_status, chat = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    if not lm_serving():  # still loading (it takes tens of seconds): both answers were 503 for that reason
        assert status == 503 and health["status"].startswith(NOT_READY), health
        assert chat_status == 503 and chat["error"]["message"].startswith(NOT_READY), chat
        models_status, models = _get(dep.url + "/v1/models")
        assert models_status == 503 and models["error"]["message"].startswith(NOT_READY), models

    wait_ready({dep.lm: lm_serving, dep.encoder: enc_serving}, deadline)
    # Admitted at the gateway's next health round (plus gRPC's reconnect backoff, at most 2 s; a loaded
    # host's slow check costs another round).
    wait_ready({dep.gateway: lambda: _admitted(dep)}, time.monotonic() + 120, poll_s=0.2)

    status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["image0"]
    assert body["epd"]["encoders"] == [dep.encoder_addr]  # through the encoder, not the LM's own
    status, models = _get(dep.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [dep.model]


def _segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("epd-") and f"-{pid}-" in n}


def test_kill_9_encoder_mid_flight_then_restart(serving, reference):
    dep = serving
    engine_pids = [p.pid for p in psutil.Process(dep.encoder.proc.pid).children(recursive=True)]
    owned = set().union(*(_segments_of(pid) for pid in engine_pids))
    assert owned, "the encoder's engine owns an outbound segment"

    bodies = [image_chat(500 + i, max_tokens=16, size=(224, 224)) for i in range(6)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(post, dep.url + "/v1/chat/completions", b, 120) for b in bodies]
        # Killed once an Encode is in flight (a fixed sleep could fire before any reached it on a
        # loaded host, or after all were done on a fast one).
        deadline = time.monotonic() + 30
        while (metric(dep.gateway_metrics, "epd_gateway_instance_outstanding", role="encoder") < 1
               and time.monotonic() < deadline and not all(f.done() for f in futures)):
            time.sleep(0.02)
        os.killpg(dep.encoder.proc.pid, signal.SIGKILL)  # service and engine processes, no cleanup
        t0 = time.monotonic()
        results = [f.result(timeout=180) for f in futures]
    elapsed = time.monotonic() - t0
    # No hang: every request ended, well before the gateway's 120 s request timeout (the LM encodes
    # the failed-over images itself; a few seconds here, which a loaded host can stretch).
    assert elapsed < 90, elapsed
    for status, body in results:
        assert status == 200 or (status >= 500 and body["error"]["message"]), (status, body)
    assert grpc_serving(dep.lm_addr, timeout=30, security=dep.client_security), "the LM stays up"

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


def _gone(p: psutil.Process) -> bool:
    """Nothing of ``p`` runs: it exited (a zombie its new parent has not reaped holds no memory)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _shm_of(tree: list[psutil.Process]) -> set[str]:
    """The /dev/shm entries the processes of ``tree`` own: the epd segments named with one of their pids,
    and every other entry one of them maps (a named semaphore, ``sem.mp-*``, is mapped under the
    temporary name it was made with: matched by inode). A peer's epd segment they attached is the
    peer's, not theirs."""
    pids = {p.pid for p in tree}
    inodes = set()
    for p in tree:
        with open(f"/proc/{p.pid}/maps") as maps:
            fields = (line.split() for line in maps)
            inodes |= {int(f[4]) for f in fields if len(f) > 5 and f[5].startswith("/dev/shm/")}
    owned = set()
    for name in os.listdir("/dev/shm"):
        epd = re.fullmatch(r"epd-[a-z]+-(\d+)-[0-9a-f]+", name)
        try:
            if int(epd.group(1)) in pids if epd else os.stat(f"/dev/shm/{name}").st_ino in inodes:
                owned.add(name)
        except FileNotFoundError:
            continue  # another process's entry, removed meanwhile
    return owned


def test_an_lm_killed_alone_leaves_no_engine_process_and_nothing_in_dev_shm(serving):
    """What systemd's ``KillMode=process``, supervisord without ``killasgroup`` or a hand-run service do:
    SIGKILL to the service's own pid, none to its engine. The engine's lifeline
    (``ectransfer.connector.lifeline``) ends the engine within ``BOUND_S``; the wait allows a loaded host
    three times that."""
    lm = serving.lm
    tree = psutil.Process(lm.proc.pid).children(recursive=True)
    engine = _engine_core(lm)
    owned = _shm_of([psutil.Process(lm.proc.pid), *tree])
    assert _segments_of(engine) <= owned and _segments_of(engine), "the LM's engine owns its staging segment"
    try:
        os.kill(lm.proc.pid, signal.SIGKILL)  # the service alone, not its group
        lm.proc.wait()
        t0 = time.monotonic()
        while (not all(map(_gone, tree)) or any(os.path.exists(f"/dev/shm/{n}") for n in owned)) and \
                time.monotonic() - t0 < 3 * BOUND_S:
            time.sleep(0.1)
        assert all(map(_gone, tree)), [(p.pid, p.name()) for p in tree if not _gone(p)]
        assert not {n for n in owned if os.path.exists(f"/dev/shm/{n}")}, "the LM's shared memory outlived it"
    finally:
        for p in tree:  # what outlived the service (a failure above), so the tests after start clean
            if not _gone(p):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        lm.start(dict(os.environ, PYTHONUNBUFFERED="1"))  # the next test's fixture waits until it is admitted


def test_a_killed_lm_engine_turns_the_lm_not_serving_and_it_exits_non_zero(serving):
    dep = serving
    status, body = post(dep.url + "/v1/chat/completions", image_chat(0), timeout=120)
    assert status == 200, body
    os.kill(_engine_core(dep.lm), signal.SIGKILL)
    _not_serving_within(dep, dep.lm, 30)
    assert dep.lm.proc.wait(60) != 0, dep.lm.log_tail()
    status, body = post(dep.url + "/v1/chat/completions", image_chat(1), timeout=60)
    assert status >= 500, (status, body)  # a clear error, not a hang


def test_a_killed_encoder_engine_turns_the_encoder_not_serving_and_it_exits_non_zero(dep):
    assert grpc_serving(dep.encoder_addr, timeout=30, security=dep.client_security)
    os.kill(_engine_core(dep.encoder), signal.SIGKILL)
    _not_serving_within(dep, dep.encoder, 30)
    assert dep.encoder.proc.wait(60) != 0, dep.encoder.log_tail()
    assert "engine" in dep.encoder.log_tail(60).lower()
