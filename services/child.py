"""A service run as a child process of this one: its command line and log (``Service``), the port it
will bind (``free_port``), and waiting until it is ready (``wait_ready``).

``epd up`` (``services.up.Deployment``), the e2e tests and the benchmarks start services with these.
Whoever starts a ``Service`` stops it: ``stop`` (or ``terminate`` then ``finish``) asks it to stop its
own engine in order, then kills what is left of its session (each child runs in a session of its own,
so its vLLM engine processes go down with it).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.spawn import child_env
from services.startup_errors import ERROR_PREFIX, summary_from_log

_rng = random.Random()  # its own generator: a test that seeds ``random`` must not make ports repeat
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_range() -> tuple[int, int]:
    """``[first, last)`` that :func:`free_port` draws from: ``$EPD_PORT_RANGE``
    (``FIRST-LAST``, inclusive) when set, else the 12000 ports just below the
    kernel's ephemeral range. Two programs that pick ports on one host at the
    same time (``make test``'s two tiers) get disjoint ranges, so neither can
    take a port the other checked and has not bound yet."""
    spec = os.environ.get("EPD_PORT_RANGE", "").strip()
    if spec:
        try:
            first, last = (int(x) for x in spec.split("-"))
        except ValueError:
            raise ValueError(f"EPD_PORT_RANGE={spec!r}: expected FIRST-LAST, e.g. 20000-25999") from None
        if not 1024 <= first <= last <= 65535:
            raise ValueError(f"EPD_PORT_RANGE={spec!r}: expected 1024 <= FIRST <= LAST <= 65535")
        return first, last + 1
    low = _ephemeral_low()
    return max(1024, low - 12000), low


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a service started next to bind.

    Chosen below the kernel's ephemeral range (or in ``$EPD_PORT_RANGE``):
    between this check and the service's bind, any outgoing connection (vLLM's
    ZMQ sockets, gRPC clients) or port-0 bind on the host may take an
    ephemeral port, never this one. Ports are random and never handed out
    twice by one process.
    """
    first, end = _port_range()
    for _ in range(100):
        port = _rng.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # that range is full: an ephemeral port, free now at least
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(eq=False)
class Service:
    name: str
    args: list[str]
    log_path: str
    proc: subprocess.Popen | None = None
    address: str = ""
    """host:port of its API (set by Deployment)."""
    metrics_port: int = 0
    command: list[str] = field(default_factory=list)
    """The whole command line; empty: ``python -m services.cli`` with ``args``."""

    @property
    def argv(self) -> list[str]:
        return self.command or [sys.executable, "-m", "services.cli", *self.args]

    def start(self, env: dict[str, str] | None = None) -> Service:
        """``env``: the child's whole environment (None: a copy of this process's)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_env() if env is None else env, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        self.terminate()
        self.finish(time.monotonic() + grace)

    def terminate(self) -> None:
        """Asks the service to stop (SIGTERM): it stops its own engine in order."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Waits for a ``terminate``d service until ``deadline`` (monotonic); then SIGKILL for what is
        left of its session (stragglers: engine processes)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ServiceExited(RuntimeError):
    """A service exited before it was ready. Its message is the reason the service printed itself
    (``summary_from_log``: what is wrong and what to do) with its log's path, or, where it printed
    none (a crash), its log's last lines."""

    def __init__(self, svc: Service) -> None:
        self.service = svc.name
        try:
            with open(svc.log_path, errors="replace") as f:
                summary = summary_from_log(f.read())
        except OSError:
            summary = ""
        super().__init__(f"{svc.name} did not start: {summary.removeprefix(ERROR_PREFIX)}\n  (its log: "
                         f"{svc.log_path})" if summary else
                         f"{svc.name} exited during start-up; last log lines:\n{svc.log_tail()}")


def wait_ready(checks: dict[Service, Callable[[], bool]], deadline: float, poll_s: float = 0.5,
               on_ready: Callable[[Service], None] | None = None,
               on_wait: Callable[[list[Service]], None] | None = None) -> None:
    """Polls each started service's readiness check until all pass. Raises ``ServiceExited`` (a
    RuntimeError: why, in the service's words or its last log lines) as soon as one exits,
    TimeoutError at ``deadline`` (``time.monotonic()``). The caller owns the processes and stops
    them on either error."""
    pending = dict(checks)
    while pending:
        for svc in list(pending):
            if not svc.alive():
                raise ServiceExited(svc)
            if pending[svc]():
                del pending[svc]
                if on_ready is not None:
                    on_ready(svc)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(s.name for s in pending)} not ready in time; last log lines:\n"
                                   + "\n".join(s.log_tail() for s in pending))
            if on_wait is not None:
                on_wait(list(pending))
            time.sleep(poll_s)
