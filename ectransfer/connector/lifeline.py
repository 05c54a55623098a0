"""An engine never outlives its service: the lifeline of a vLLM engine process to the service that
started it.

vLLM 0.32's EngineCore has no parent-death handling: killed alone (``kill -9`` of the service, as
systemd's ``KillMode=process``, supervisord without ``killasgroup`` or a hand-run service do), the
service leaves its EngineCore running, with the model in memory and its shared-memory segments
(the LM's staging, the encoder's outbound pool) held, so the next start's ``cleanup_orphans``
cannot remove them. ``prctl(PR_SET_PDEATHSIG)`` is no fit: it fires when the parent *thread*
exits, and vLLM spawns the EngineCore from whichever thread builds ``AsyncLLM``.

So the engine process watches for itself. Our EC connector is built in every engine process (role
SCHEDULER in the EngineCore, role WORKER in each worker; both in the EngineCore with the "uni"
executor); ``hold`` starts one daemon thread per process, ``epd-lifeline``, in the EngineCore only
(the process whose parent is the service): it polls ``os.getppid()`` every ``POLL_S`` seconds,
and once the service is gone (the kernel reparents the engine, so the parent pid changes) it

1. unlinks every segment this process created (``ectransfer.shm.unlink_created``): nothing of it
   stays in /dev/shm, whatever happens next;
2. arms ``faulthandler.dump_traceback_later(GRACE_S, exit=True)``: if the process is still there
   ``GRACE_S`` later, faulthandler writes every thread's stack to stderr (where the stop hung) and
   ends it with ``_exit(1)``. Its watchdog is a native thread that needs no GIL: on a CPU host
   vLLM's stop finishes its Python part at once and then hangs in the interpreter's native exit
   (most likely ZeroMQ's context waiting on a socket to the dead service), where no Python
   thread runs any more, so a Python thread sleeping out the grace never woke;
3. sends this process SIGTERM: vLLM's EngineCore handler ends its busy loop and shuts down in order
   (its executor and worker processes, our connector halves).

The engine is gone within ``BOUND_S`` of its service on a host that gives it CPU. vLLM's worker
processes (the "mp" executor) watch the EngineCore themselves (their death pipe) and follow it.
Python's resource tracker, which the service started when it spawned the engine, exits once every
process holding its pipe has (the service, the EngineCore, its workers), unlinking what they
registered and never released.

The service's pid travels in the connector's configuration (``ConnectorConfig.service_pid``, set
by ``ec_transfer_config`` in the service process). No pid (0), or an engine in the service's own
process, and there is nothing to watch.
"""

from __future__ import annotations

import enum
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from ectransfer import shm

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the lifeline reads the parent pid."""
GRACE_S = 5.0
"""How long vLLM's own shutdown may take before the process ends itself."""
BOUND_S = 10.0
"""The engine process is gone within this of its service's death: ``POLL_S + GRACE_S`` and room
for a loaded host's scheduling."""


class Standing(enum.Enum):
    """Where this process stands to the service (``standing``)."""

    UNWATCHED = "unwatched"
    """No service named, or the engine runs in the service's own process."""
    CHILD = "child"
    """The EngineCore: the service's child; the lifeline watches."""
    WORKER = "worker"
    """A worker of the engine (its parent is the EngineCore, the service lives): vLLM's worker
    follows its EngineCore."""
    ORPHANED = "orphaned"
    """The service is gone already (it died while the engine started)."""


def standing(service_pid: int, pid: int, ppid: int, alive: Callable[[int], bool]) -> Standing:
    """This process's ``Standing``, from its ``pid``, its parent's ``ppid`` and whether the service
    is ``alive``."""
    if service_pid <= 0 or pid == service_pid:
        return Standing.UNWATCHED
    if ppid == service_pid:
        return Standing.CHILD
    return Standing.WORKER if alive(service_pid) else Standing.ORPHANED


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge, so not gone
    return True


def _end_later(seconds: float) -> None:
    """Ends this process with ``_exit(1)`` ``seconds`` from now unless it ends first, after writing
    every thread's stack to stderr; a Python timer where faulthandler cannot write to stderr."""
    try:
        faulthandler.dump_traceback_later(seconds, exit=True)
    except (AttributeError, ValueError, RuntimeError, OSError):  # no stderr with a file descriptor
        threading.Timer(seconds, os._exit, (1,)).start()


class Lifeline:
    """Watches the service ``service_pid`` from its engine process and stops the process once the
    service is gone (the module docstring says how). ``start`` runs the thread; it is a daemon and
    ends with the process. ``stop`` (ask vLLM to stop) and ``end_later`` (the hard end, given the
    grace) are what it does to this process: replaceable for tests."""

    def __init__(self, service_pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S,
                 stop: Callable[[], None] | None = None,
                 end_later: Callable[[float], None] = _end_later) -> None:
        self.service_pid, self.poll_s, self.grace_s = service_pid, poll_s, grace_s
        self._stop = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._end_later = end_later
        self._thread: threading.Thread | None = None

    def start(self) -> Lifeline:
        self._thread = threading.Thread(target=self._run, name="epd-lifeline", daemon=True)
        self._thread.start()
        return self

    def service_gone(self) -> bool:
        return os.getppid() != self.service_pid

    def _run(self) -> None:
        while not self.service_gone():
            time.sleep(self.poll_s)
        self.let_go()

    def let_go(self) -> None:
        """The service is gone: frees this process's segments, arms the hard end ``grace_s`` from
        now, and asks vLLM to stop (in that order: neither of the first two waits on vLLM)."""
        removed = shm.unlink_created()
        logger.error("the service that started this engine (pid %d) is gone: unlinked %s; stopping the engine "
                     "(ended in %.0fs if it has not stopped, its threads' stacks written here)",
                     self.service_pid, ", ".join(removed) or "no shared memory", self.grace_s)
        self._end_later(self.grace_s)
        self._stop()


_held: Lifeline | None = None
"""This process's lifeline, once ``hold`` started it (one per process)."""
_unnamed = False
"""Whether ``hold`` gave tqdm its lock in this process (once: a lock in use is never swapped)."""
_lock = threading.Lock()


def hold(service_pid: int) -> Standing:
    """Called by the connector in each engine process it is built in (both roles, so twice in a
    one-process engine): starts this process's lifeline once where it is the service's child, and
    ends an orphan's start at once. Where a service is named, also gives tqdm a lock without a name
    (``unnamed_progress_lock``). Returns where this process stands."""
    global _held, _unnamed
    where = standing(service_pid, os.getpid(), os.getppid(), _alive)
    if where is Standing.UNWATCHED:
        return where
    with _lock:
        if not _unnamed:
            unnamed_progress_lock()
            _unnamed = True
        if _held is None and where is not Standing.WORKER:
            _held = Lifeline(service_pid).start()  # an orphan's lifeline lets go at its first look
    return where


def unnamed_progress_lock() -> None:
    """Gives tqdm a thread lock before vLLM's weight loader first draws a progress bar. tqdm would
    otherwise create a multiprocessing lock (a POSIX semaphore, ``/dev/shm/sem.mp-*``) that lives as
    long as the process and that only the process's exit or Python's resource tracker unlinks: a
    kill of the service's whole process group (tracker included) leaves it behind. Bars from
    several processes may interleave; nothing else changes (``tqdm.set_lock`` is tqdm's own API)."""
    from tqdm import tqdm
    from tqdm.std import TRLock

    tqdm.set_lock(TRLock())
