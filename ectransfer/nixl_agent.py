"""This process's NIXL agents and the encoder's progress thread, for ``ectransfer.nixl``.

``process_agent(role)`` makes one agent per process and role (an encoder has a producer's, an LM a
consumer's; a test or benchmark process may have both) on first use and never destroys it (NIXL
has no destroy; it goes with the process). ``Progress`` is owned by ``NixlProducer``: started in its
``build``, stopped in its ``close``.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import threading
import time
import weakref

logger = logging.getLogger(__name__)

OUTSTANDING_S = 10.0  # the producer drives progress for a described item at most this long without its notif
IDLE_POLL_S = 0.01  # the producer's progress with nothing outstanding (a stray READ still completes)


def usable() -> str | None:
    """None when NIXL with its UCX plugin can be imported here, else why not (nothing is started)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or a CUDA build whose libraries do not load
        return f"NIXL is not importable here ({e})"
    return None


class Agent:
    """This process's NIXL agent (``process_agent``): UCX only, NIXL's listen thread and its
    spinning progress thread off, thread-safe (the producer's ``Progress`` thread and the
    transfer threads use it at once)."""

    def __init__(self, role: str) -> None:
        # UCX reads its settings when the agent is made. Unless the operator chose its modules, leave
        # out UCX's EFA module: in NIXL's wheel it loads the system's libefa, whose second copy of
        # libnl next to the wheel's own crashes the process at exit (SIGSEGV in libnl's destructor)
        # on hosts with rdma-core installed. EFA clusters set UCX_MODULES themselves.
        os.environ.setdefault("UCX_MODULES", "^efa")
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = f"epd-{role}-{os.getpid()}-{secrets.token_hex(6)}"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.nixl = nixl_agent(self.name, config)
        if "UCX" not in self.nixl.backends:
            raise RuntimeError("NIXL has no UCX plugin here")
        self.mem_types = set(self.nixl.get_backend_mem_types("UCX"))

    def register(self, address: int, nbytes: int, mem_type: str, device_id: int):
        return self.nixl.register_memory([(address, nbytes, device_id, "")], mem_type)

    def deregister(self, descs) -> None:
        try:
            self.nixl.deregister_memory(descs)
        except Exception as e:  # noqa: BLE001 - closing: log and go on
            logger.warning("NIXL: deregistering memory failed: %s", e)


_agents: dict[str, Agent] = {}
_agent_lock = threading.Lock()


def process_agent(role: str) -> Agent:
    """The process's agent for ``role`` ("producer" or "consumer"), made on first use (about
    half a second: UCX's initialisation)."""
    with _agent_lock:
        if role not in _agents:
            _agents[role] = Agent(role)
        return _agents[role]


_running: weakref.WeakSet[Progress] = weakref.WeakSet()
"""Every started ``Progress`` not yet stopped: ``_kept_at_exit`` stops them."""


def _kept_at_exit() -> None:
    """Makes the interpreter's exit safe with NIXL in the process (an atexit hook: it runs before the
    interpreter starts to finalize, while every thread can still run):

    - Every ``Progress`` thread still running is stopped and joined. A daemon thread inside a NIXL call
      (which releases the GIL) when finalization begins is ended by Python with ``pthread_exit`` as it
      takes the GIL back; that unwinds through the binding's C++ frames, whose GIL guard's destructor is
      ``noexcept``, and the C++ runtime ends the whole process: "terminate called without an active
      exception", SIGABRT after a clean run. A producer its owner never closed would otherwise leave one.
    - The process's agents are left to the operating system, never destroyed: NIXL's agent destructor,
      run while the interpreter finalizes its modules (after UCX has lost a peer, say), could end the
      process the same way. The memory, sockets and registrations of an exiting process go with it
      anyway. One more reference each, taken here, is what keeps them."""
    for progress in list(_running):
        progress.stop()
    with _agent_lock:
        for agent in _agents.values():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent.nixl))


class Progress:
    """Drives the producer agent's UCX worker (a READ over TCP needs the target to progress).

    Owned by ``NixlProducer`` (started in ``build``, stopped in ``close``). ``expect(token)``
    (the server's loop thread, per item described) marks a READ outstanding; the READ's
    notification carries the token back and ends it, and so does ``OUTSTANDING_S``. While any
    is outstanding the thread spins on ``get_new_notifs`` (which progresses the worker), else it
    polls every ``IDLE_POLL_S``: an idle encoder spends no core on NIXL."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._outstanding: dict[bytes, float] = {}  # notif token -> deadline (time.monotonic)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epd-nixl-progress", daemon=True)
        self.completed = 0  # notifications that ended an outstanding read (tests, stats)

    def start(self) -> None:
        _running.add(self)
        self._thread.start()

    def expect(self, token: bytes) -> None:
        with self._lock:
            self._outstanding[token] = time.monotonic() + OUTSTANDING_S
        self._wake.set()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self.agent.nixl.get_new_notifs()
            except Exception:  # never let the thread die; the next call retries
                logger.exception("NIXL progress failed")
                notifs = {}
            now = time.monotonic()
            with self._lock:
                for msgs in notifs.values():
                    for msg in msgs:
                        if self._outstanding.pop(bytes(msg), None) is not None:
                            self.completed += 1
                for token in [t for t, deadline in self._outstanding.items() if deadline < now]:
                    del self._outstanding[token]
                busy = bool(self._outstanding)
            if busy:
                time.sleep(0)  # let the transfer threads run between polls
            else:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        _running.discard(self)


atexit.register(_kept_at_exit)
