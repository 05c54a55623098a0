"""``epd gateway --workers N`` as a subprocess (its supervisor and its workers) against a stub LM
subprocess (bench/stub_lm.py), for the tests of the gateway's worker processes; which worker holds
which client's connection is read from the workers' sockets (psutil).

Ports: the stub LM and the gateway's REST API bind port 0 and say in their logs which port they got
(the supervisor reserves one for every worker); the gRPC API (port 0 means "disabled") and the
internal metrics port get one from ``services.up.free_port``, below the kernel's ephemeral range.
Every wait is a poll with a generous deadline: nothing here times how fast a process is."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.workers import WorkerSeat
from services.up import free_port

CHECKOUT = Path(__file__).resolve().parents[2]
DEADLINE_S = 90.0
"""The longest any state is waited for: a hang guard, never a measure."""


def poll(fetch: Callable[[], Any], done: Callable[[Any], bool], what: str, timeout: float = DEADLINE_S) -> Any:
    """``fetch()`` until ``done(result)``; AssertionError with the last result after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = fetch()
        if done(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what} (last: {result})")
        time.sleep(0.1)


def _logged(path: Path, pattern: str, proc: subprocess.Popen, what: str) -> re.Match:
    """The first match of ``pattern`` in the log at ``path``, once it is there."""
    def find():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{path.read_text()[-3000:]}")
        return re.search(pattern, path.read_text())

    return poll(find, bool, what)


class StubLM:
    """bench/stub_lm.py on a port of its own choosing: ``address`` is its host:port."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = tmp_path / "stub_lm.log"
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> StubLM:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(CHECKOUT / "bench" / "stub_lm.py"), "--port", "0"],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT)
        self.address = _logged(self.log, r"stub lm ready: (\S+:\d+)", self.proc, "the stub LM")[1]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(DEADLINE_S)


class WorkersGateway:
    """``epd gateway --workers N`` on loopback in front of ``lm`` (host:port), in a session of its own
    (teardown can end whatever is left of it). ``port``, ``grpc_port``, ``metrics_port``: its ports."""

    def __init__(self, tmp_path: Path, lm: str, workers: int = 2) -> None:
        self.log = tmp_path / "gateway.log"
        self.lm, self.n = lm, workers
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.store: int | None = None
        """The pid of the private store's redis-server (a session of its own; it ends with its supervisor's thread,
        and teardown ends it when a failed test left it)."""

    def __enter__(self) -> WorkersGateway:
        argv = [sys.executable, "-m", "services.cli", "gateway", "--workers", str(self.n), "--port", "0",
                "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), "--lms", self.lm,
                "--health-interval-s", "0.2", "--idle-timeout-s", "600"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT,
                                         start_new_session=True)
        self.port = int(_logged(self.log, r"gateway: \d+ workers on http://[^:]+:(\d+)/", self.proc,
                                "the gateway's supervisor")[1])
        self.store = self.store_pid()
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever a failed test left of the session
        self.proc.wait()
        if self.store is not None and not reaped(self.store):
            with contextlib.suppress(psutil.Error):
                store = psutil.Process(self.store)
                if "redis-server" in store.name():
                    store.kill()

    # --- the processes ------------------------------------------------------------------------------------------

    def workers(self) -> list[psutil.Process]:
        """The supervisor's live worker processes."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if _is_worker(p)]

    def seat(self, worker: psutil.Process) -> WorkerSeat:
        cmdline = worker.cmdline()
        return WorkerSeat.from_flag(cmdline[cmdline.index("--worker-of") + 1])

    def store_pid(self) -> int | None:
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        return next((p.pid for p in children if "redis-server" in p.name()), None)

    def listening(self, worker: psutil.Process) -> bool:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in _sockets(worker))

    def owners(self, port: int) -> dict[int, int]:
        """Client port -> the pid of the worker whose socket holds that client's connection to ``port``."""
        return {c.raddr.port: w.pid for w in self.workers() for c in _sockets(w)
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port and c.raddr}

    def wait_ready(self) -> list[psutil.Process]:
        """Until N workers listen and every live worker admits the LM (the merged gauge's minimum)."""
        def ready():
            live = self.workers()
            ok = len(live) == self.n and all(self.listening(w) for w in live)
            return live if ok and self.metric("epd_gateway_instance_healthy", role="lm", instance=self.lm) == 1 else None

        return poll(ready, bool, f"{self.n} workers listening, each with the LM admitted")

    # --- the APIs -----------------------------------------------------------------------------------------------

    def connect(self) -> http.client.HTTPConnection:
        """A new connection to the REST API, opened now (the kernel hands it to one worker)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=DEADLINE_S)
        conn.connect()
        return conn

    def call(self, method: str, path: str, body: dict | None = None,
             conn: http.client.HTTPConnection | None = None) -> tuple[int, Any]:
        """One request on ``conn`` (default: a new connection, closed after); (status, JSON or text)."""
        return call_json(conn or self.connect(), method, path, body, close=conn is None)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples with ``labels`` on the internal port's (merged) /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=DEADLINE_S) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())


def client_port(conn: http.client.HTTPConnection) -> int:
    return conn.sock.getsockname()[1]


def _is_worker(p: psutil.Process) -> bool:
    try:
        return "--worker-of" in p.cmdline()
    except psutil.Error:
        return False


def _sockets(p: psutil.Process) -> list:
    try:
        return p.net_connections(kind="tcp")
    except psutil.Error:
        return []


def exited(pid: int) -> bool:
    """The process has exited, or its main thread has (a zombie whose other threads may still be closing
    its sockets)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reaped(pid: int) -> bool:
    """Its parent has reaped the process: every thread of it is gone, and every socket it held closed."""
    return not psutil.pid_exists(pid)


def call_json(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None,
              headers: dict | None = None, close: bool = True) -> tuple[int, Any]:
    """One JSON request on ``conn`` (closed after, unless ``close`` is False); (status, JSON or text)."""
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
    finally:
        if close:
            conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text
