"""The engine process's lifeline (``ectransfer.connector.lifeline``): where a process stands to its
service, what letting go does, and a process whose service is killed alone ends and leaves nothing
in /dev/shm (no engine here: a small Python process stands in for the EngineCore)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ectransfer import shm
from ectransfer.connector import lifeline
from ectransfer.connector.config import ConnectorConfig, ec_transfer_config
from ectransfer.connector.lifeline import Lifeline, Standing, standing

pytestmark = pytest.mark.unit

SERVICE = 100


@pytest.mark.parametrize("service_pid, pid, ppid, alive, expected", [
    (0, 200, SERVICE, True, Standing.UNWATCHED),  # no service named
    (SERVICE, SERVICE, 1, True, Standing.UNWATCHED),  # the engine runs in the service's own process
    (SERVICE, 200, SERVICE, True, Standing.CHILD),  # the EngineCore
    (SERVICE, 300, 200, True, Standing.WORKER),  # a worker under the EngineCore
    (SERVICE, 200, 1, False, Standing.ORPHANED),  # the service died while the engine started
])
def test_a_process_stands_to_its_service_by_its_parent_and_the_services_life(service_pid, pid, ppid, alive,
                                                                               expected):
    assert standing(service_pid, pid, ppid, lambda _pid: alive) is expected


def test_hold_watches_nothing_in_the_services_own_process_or_without_a_service():
    assert lifeline.hold(os.getpid()) is Standing.UNWATCHED
    assert lifeline.hold(0) is Standing.UNWATCHED
    assert lifeline._held is None


def test_the_connector_config_names_the_process_that_builds_the_engine():
    extra = ec_transfer_config("ec_consumer", ConnectorConfig())["ec_connector_extra_config"]
    assert extra["service_pid"] == os.getpid()
    assert ConnectorConfig.from_extra(extra).service_pid == os.getpid()
    named = ec_transfer_config("ec_producer", ConnectorConfig(service_pid=4242))["ec_connector_extra_config"]
    assert named["service_pid"] == 4242


def test_letting_go_unlinks_this_process_segments_then_arms_the_hard_end_then_asks_vllm_to_stop():
    seg = shm.ShmSegment.create(shm.new_name("test"), 4096)
    path = os.path.join(shm.SHM_DIR, seg.name)
    calls = []
    try:
        Lifeline(SERVICE, grace_s=3, stop=lambda: calls.append(("stop", os.path.exists(path))),
                 end_later=lambda s: calls.append(("end in", s, os.path.exists(path)))).let_go()
        # Unlinked first and the end armed before vLLM is asked: its stop may never finish.
        assert calls == [("end in", 3, False), ("stop", False)]
        assert seg.buffer.numel() == 4096  # the mapping itself stays valid
    finally:
        seg.close()
    assert seg.name not in shm._created


def test_a_closed_segment_is_no_longer_this_process_to_unlink():
    seg = shm.ShmSegment.create(shm.new_name("test"), 4096)
    assert seg.name in shm._created
    seg.close()
    assert seg.name not in shm._created and seg.name not in shm.unlink_created()


ENGINE = textwrap.dedent("""
    import signal, sys, time
    from ectransfer import shm
    from ectransfer.connector.lifeline import Lifeline
    if sys.argv[2] == "ignores":  # a stop that never finishes: only the hard end ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seg = shm.ShmSegment.create(shm.new_name("test"), 4096)
    Lifeline(int(sys.argv[1]), poll_s=0.05, grace_s=0.5).start()
    print(seg.name, flush=True)
    time.sleep(600)
""")

SERVICE_PROCESS = textwrap.dedent("""
    import os, subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]],
                              stdout=subprocess.PIPE, text=True)
    print(engine.pid, engine.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    """Nothing of ``pid`` runs: it exited (a zombie its new parent has not reaped holds no memory)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sigterm", ["obeys", "ignores"])
def test_a_process_whose_service_is_killed_alone_ends_and_leaves_nothing_in_dev_shm(sigterm):
    service = subprocess.Popen([sys.executable, "-c", SERVICE_PROCESS, ENGINE, sigterm], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    engine_pid = 0
    try:
        engine_pid, segment = service.stdout.readline().split()
        engine_pid = int(engine_pid)
        assert os.path.exists(os.path.join(shm.SHM_DIR, segment))
        os.kill(service.pid, signal.SIGKILL)  # the service alone, not its group
        service.wait()
        deadline = time.monotonic() + 60  # a generous wait for a loaded host; the lifeline takes under a second
        while not _gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(engine_pid), "the engine outlived its service"
        assert not os.path.exists(os.path.join(shm.SHM_DIR, segment)), "the engine's segment was left behind"
    finally:
        if service.poll() is None:
            service.kill()
        if engine_pid and not _gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
