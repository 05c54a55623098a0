"""The gateway as several processes on one host (``epd gateway --workers N``): a supervisor and N
workers, each worker a whole gateway (``services.gateway.server.serve``) serving the same REST, gRPC
and internal metrics ports.

How N processes serve one port: SO_REUSEPORT. Each worker binds every port itself (aiohttp's
``reuse_port``, grpcio's ``grpc.so_reuseport``) and the kernel spreads new connections over the
workers by the hash of their addresses. Not a pre-fork (one listening socket made by the supervisor and
inherited): grpcio serves only sockets it binds itself, and a worker must be a fresh interpreter anyway
(gRPC's threads do not survive ``fork()``), so both APIs share one mechanism. Its cost: connections a
worker had been handed by the kernel but had not yet accepted are reset when it dies (their requests
had not started; Linux's ``net.ipv4.tcp_migrate_req=1`` hands them to another worker instead).
Connections made after it died go to the others.

The supervisor (``Supervisor``: the ``epd gateway`` process itself, no gateway inside it) owns, from
``start`` until ``stop`` returns:

- the ports: one socket per port, bound with SO_REUSEPORT alone and never listening (``reserve``). It
  gets the port for ``--port 0``, holds the port while no worker does (between a death and the
  replacement's bind), and keeps off it any process that does not ask for SO_REUSEPORT or runs as
  another user. It takes no connection: the kernel hands connections to listening sockets only.
- the metrics directory (``mkdtemp``, 0700), where every worker's prometheus_client keeps its values
  (``metrics.registry`` merges them): a dead worker's live gauges are dropped (``mark_process_dead``),
  and the directory is removed at the end.
- the private state store (``StoreServer``: a redis-server on a Unix socket, with a password file) the
  workers' limits are to be shared through (``WorkerSeat.state_store``), and the state secret the
  response ids are signed with when none is configured (``services.gateway.responses``: an id one
  worker minted is then served by any other).
- the workers: each a fresh ``python -m services.cli gateway``, given the supervisor's configuration
  as flags (the API keys in its environment, never on its command line) and its ``WorkerSeat``
  (``--worker-of``). They stay in the supervisor's process group, so a kill of the group (``epd up``'s
  last resort) reaches them all.

A worker that exits while the supervisor is not stopping is replaced, after a pause that doubles with
each death soon after a start (``Backoff``: 0.5 s up to 30 s, 0.5 s again after one ran 30 s). A worker
that could not start the first time (exit status 2: a configuration or a port it refused) stops the
whole gateway with that status: its replacements would fail alike. SIGTERM and SIGINT stop the
supervisor: SIGTERM to every worker (each stops as one gateway does: NOT_SERVING, the listeners, the
calls in flight, the pools), SIGKILL to any still running after ``STOP_TIMEOUT_S``; then the store,
the directory and the ports. SIGHUP is passed on (each worker reloads its API keys).

A worker watches its supervisor (``watch_supervisor``) and stops once it is gone (``kill -9``): no
worker serves a port that no supervisor holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peerauth import SecurityConfig
from services.common.config import to_args
from services.common.spawn import child_env
from services.gateway import metrics
from services.gateway.config import API_KEYS_ENV, GatewayConfig
from services.gateway.responses import SECRET_ENV
from services.gateway.state.config import StateStoreConfig
from services.startup_errors import StartupError, check_port

if TYPE_CHECKING:
    from services.gateway.state.store_server import StoreServer

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 75.0
"""How long stopping workers may take before SIGKILL: aiohttp's 60 s for the handlers in flight, and
gRPC's grace."""
COULD_NOT_START = 2
"""The exit status of ``epd gateway`` that refused its configuration or could not start."""
WATCH_EVERY_S = 1.0
"""How often a worker checks that its supervisor is still there."""
JOIN_WAIT_S = 30.0
"""The longest a replacement worker waits for an LM before it binds (``ready_to_join``)."""


@dataclass(frozen=True)
class WorkerSeat:
    """What a worker is told of its place (``--worker-of``, JSON): its supervisor's pid, its index
    among ``count`` workers, whether it replaces one (``joining``: the others serve meanwhile), and the
    private state store its supervisor started (empty: none)."""

    supervisor: int
    index: int
    count: int
    joining: bool = False
    store: str = ""
    store_password_file: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> WorkerSeat:
        return cls(**d)

    def to_flag(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_flag(cls, text: str) -> WorkerSeat:
        """Raises ValueError for anything but a seat (``--worker-of`` is set by the supervisor only)."""
        try:
            seat = cls.from_dict(json.loads(text))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--worker-of is set by the gateway's supervisor, not by hand: {e}") from None
        if not 0 <= seat.index < seat.count:
            raise ValueError(f"--worker-of: index {seat.index} is not among {seat.count} workers")
        return seat

    def state_store(self) -> StateStoreConfig | None:
        """This worker's part of the shared state: the store its supervisor started, shared by ``count``
        processes (None: there is none; ``services.gateway.state.wiring`` opens it)."""
        if not self.store:
            return None
        return StateStoreConfig(url=self.store, password_file=self.store_password_file, processes=self.count,
                                index=self.index)


class Backoff:
    """The pause before a dead worker's replacement: ``first_s``, doubled for each death within
    ``stable_s`` of its start, at most ``most_s``; ``first_s`` again after a worker that ran ``stable_s``."""

    def __init__(self, first_s: float = 0.5, most_s: float = 30.0, stable_s: float = 30.0) -> None:
        self.first_s, self.most_s, self.stable_s = first_s, most_s, stable_s
        self._quick_deaths = 0

    def after(self, lived_s: float) -> float:
        """The pause after a worker that lived ``lived_s`` seconds died."""
        if lived_s >= self.stable_s:
            self._quick_deaths = 0
        pause = min(self.most_s, self.first_s * 2 ** self._quick_deaths)
        self._quick_deaths += 1
        return pause


def reserve(flag: str, host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT alone, never listening (port 0: a free one),
    that the caller closes (the module docstring says why). ``StartupError`` when the port is in use:
    ``check_port`` first, so that a port another process of this user serves with SO_REUSEPORT (another
    gateway's workers, a gRPC server) is refused rather than shared."""
    check_port(flag, host, port)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise StartupError(f"{flag} {port}: cannot bind {host}:{port}: {e.strerror or e}",
                           f"pass another {flag}") from None
    return sock


def needs_private_store(cfg: GatewayConfig) -> bool:
    """Whether the supervisor starts the workers' private state store: several workers, and no store of
    the operator's (``--state-store``, which every worker then opens itself)."""
    return cfg.workers > 1 and not cfg.state_store


def worker_argv(cfg: GatewayConfig, security: SecurityConfig, seat: WorkerSeat, log_level: str) -> list[str]:
    """A worker's command line: ``cfg`` and ``security`` as flags but the API keys (``worker_env``)."""
    return [sys.executable, "-m", "services.cli", "--log-level", log_level, "gateway",
            *to_args(cfg, skip=frozenset({"api_key"})), *to_args(security), "--worker-of", seat.to_flag()]


def worker_env(cfg: GatewayConfig, metrics_dir: str, secret: str) -> dict[str, str]:
    """A worker's environment: this process's, with the metrics directory, ``cfg``'s API keys (off the
    command line) and ``secret`` (the response ids' state secret; empty: the one configured)."""
    extra = {metrics.MULTIPROCESS_DIR_ENV: metrics_dir}
    if cfg.api_key:
        extra[API_KEYS_ENV] = "\n".join(cfg.api_key)
    if secret:
        extra[SECRET_ENV] = secret
    return child_env(extra)


@dataclass
class _Slot:
    """One worker's place: the process last started in it (None: none yet), how often, and its backoff."""

    index: int
    backoff: Backoff = dataclasses.field(default_factory=Backoff)
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0


class Supervisor:
    """Runs ``cfg.workers`` workers (the module docstring says what it owns and how it stops):
    ``start``, then ``run`` until its ``stop`` event is set, then ``stop`` (also after a failed start)."""

    def __init__(self, cfg: GatewayConfig, security: SecurityConfig) -> None:
        self.cfg, self.security = cfg, security
        self.slots = [_Slot(i) for i in range(cfg.workers)]
        self.metrics_dir = ""
        self._reserved: list[socket.socket] = []
        self._store: StoreServer | None = None
        self._env: dict[str, str] = {}
        self._keepers: list[asyncio.Task] = []

    async def start(self) -> None:
        """Reserves the ports, makes the metrics directory, starts the private store; no worker yet."""
        cfg = self.cfg
        http = reserve("--port", cfg.host, cfg.port)
        self._reserved.append(http)
        self.cfg = dataclasses.replace(cfg, port=http.getsockname()[1])  # --port 0: the one reserved
        if cfg.grpc_port:
            self._reserved.append(reserve("--grpc-port", cfg.host, cfg.grpc_port))
        if cfg.metrics_port:
            self._reserved.append(reserve("--metrics-port", cfg.metrics_host, cfg.metrics_port))
        self.metrics_dir = tempfile.mkdtemp(prefix="epd-gateway-metrics-")
        if needs_private_store(cfg):
            # On this thread, not a helper's: the store dies with the thread that started it (store_server).
            self._store = _start_store()
        configured = cfg.state_secret_file or os.environ.get(SECRET_ENV)
        self._env = worker_env(cfg, self.metrics_dir, "" if configured else secrets.token_hex(32))
        logger.info("gateway: %d workers on http://%s:%d/v1 (metrics of every worker in %s)", cfg.workers, cfg.host,
                    self.cfg.port, self.metrics_dir)

    def seat(self, slot: _Slot) -> WorkerSeat:
        store = self._store
        return WorkerSeat(os.getpid(), slot.index, self.cfg.workers, joining=slot.starts > 0,
                          store=store.url if store else "", store_password_file=store.password_file if store else "")

    async def run(self, stop: asyncio.Event) -> None:
        """Keeps every worker running until ``stop`` is set; raises ``StartupError`` (``stop`` set) when
        a worker could not start the first time."""
        self._keepers = [asyncio.create_task(self._keep(slot, stop), name=f"gateway worker {slot.index}")
                         for slot in self.slots]
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *self._keepers], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        for task in done - {stopping}:
            task.result()  # a keeper ends before stop only by raising

    async def _keep(self, slot: _Slot, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            proc = await self._spawn(slot)
            if stop.is_set():  # stop came while it was starting: it missed the SIGTERM
                proc.terminate()
            status = await proc.wait()
            self._forget(proc.pid)
            if stop.is_set():
                return
            if status == COULD_NOT_START and slot.starts == 1:
                raise StartupError(f"gateway worker {slot.index} could not start (exit status {status})",
                                   "its reason is in the lines above")
            pause = slot.backoff.after(time.monotonic() - started)
            logger.warning("gateway worker %d (pid %d) exited with status %s; a new one in %.1f s", slot.index,
                           proc.pid, status, pause)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)

    async def _spawn(self, slot: _Slot) -> asyncio.subprocess.Process:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        slot.proc = await asyncio.create_subprocess_exec(*worker_argv(self.cfg, self.security, self.seat(slot),
                                                                      level), env=self._env)
        slot.starts += 1
        logger.info("gateway worker %d started (pid %d)", slot.index, slot.proc.pid)
        return slot.proc

    def _forget(self, pid: int) -> None:
        """A dead worker's live gauges leave the merged metrics (its counts stay: they happened)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self.metrics_dir)

    def signal_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    async def stop(self) -> None:
        """SIGTERM to every worker, SIGKILL past ``STOP_TIMEOUT_S``; then the store, the directory and the
        ports. Safe after a failed ``start``."""
        self.signal_all(signal.SIGTERM)
        if self._keepers:
            _, late = await asyncio.wait(self._keepers, timeout=STOP_TIMEOUT_S)
            if late:
                logger.warning("gateway: %d worker(s) still running after %.0f s: SIGKILL", len(late), STOP_TIMEOUT_S)
                self.signal_all(signal.SIGKILL)
                await asyncio.wait(late)
        if self._store is not None:
            await asyncio.to_thread(self._store.stop)
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        for sock in self._reserved:
            sock.close()


def _start_store() -> StoreServer:
    """The workers' private state store, started (``StartupError`` when it cannot be)."""
    try:
        from services.gateway.state.store_server import StoreServer

        return StoreServer().start()
    except (ImportError, RuntimeError) as e:
        raise StartupError(f"the gateway workers' state store could not start: {e}",
                           "install redis-server (or valkey-server), or run one gateway process (--workers 1)") from None


async def supervise(cfg: GatewayConfig, security: SecurityConfig, stop: asyncio.Event) -> None:
    """``epd gateway --workers N`` (N > 1): runs the workers until SIGTERM or SIGINT (or ``stop``)."""
    supervisor = Supervisor(cfg, security)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, supervisor.signal_all, signal.SIGHUP)
    try:
        await supervisor.start()
        await supervisor.run(stop)
    finally:
        await supervisor.stop()


async def ready_to_join(seat: WorkerSeat | None, lm_ready: Callable[[], bool]) -> None:
    """A replacement worker's wait before it binds: the other workers serve the port meanwhile, so it
    joins them once it has an LM (``lm_ready``), not to answer 503 where they answer; or after
    ``JOIN_WAIT_S`` (no LM for anyone: it answers as they do). A first worker binds at once, as one
    gateway does (and one gateway, ``seat`` None, does)."""
    deadline = time.monotonic() + JOIN_WAIT_S
    while seat is not None and seat.joining and not lm_ready() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def serving(seat: WorkerSeat, stop: asyncio.Event) -> asyncio.Task:
    """A worker that listens: counted (``epd_gateway_worker_starts_total``), and watching its supervisor
    (the task ``watch_supervisor``; its caller cancels it when it stops)."""
    metrics.WORKER_STARTS.inc()
    return asyncio.create_task(watch_supervisor(seat, stop), name="supervisor watch")


async def watch_supervisor(seat: WorkerSeat, stop: asyncio.Event) -> None:
    """A worker's watch: sets ``stop`` once its supervisor is gone (it is then some other process's child)."""
    while not stop.is_set():
        if os.getppid() != seat.supervisor:
            logger.warning("gateway worker %d: its supervisor (pid %d) is gone; stopping", seat.index, seat.supervisor)
            stop.set()
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCH_EVERY_S)
