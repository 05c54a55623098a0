"""NIXL's side channel, watched from a prefill LM's service process (decode LMs dial it).

vLLM's NixlConnector answers handshakes (the engine's NIXL agent metadata) from one thread in the
EngineCore process, ``nixl_handshake_listener``, on ``--kv-host``:``--kv-port``. Our connector runs a
guarded loop there (``services.lm.nixl_listener``: a bad message is dropped, a failed socket bound
again), so this watch is the second line: for a listener that stops anyway (its port cannot be bound
again, the thread died of something no guard catches), when every later pairing with this LM would
fail while the engine, and so the LM's health, stay fine. The thread is in another process, but its
port is not hidden: once the thread is gone nothing accepts a connection there.

``SideChannelWatch`` connects to that port every ``interval_s`` (a TCP connect, closed at once: the
listener's ZMQ socket drops a peer that never speaks, and the thread never sees it). After
``failures`` failed probes in a row it logs why, sets ``epd_lm_kv_side_channel_up`` to 0 and awaits
``on_dead(reason)``; the LM service marks itself NOT_SERVING there (the gateway ejects it; Kubernetes'
liveness probe, which asks for "", restarts the pod). The listener cannot be started again without
its engine, so the watch then ends. The service owns the watch: ``start`` after the engine is up
(vLLM starts the listener while the EngineCore starts), ``stop`` on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge

logger = logging.getLogger(__name__)

UP = Gauge("epd_lm_kv_side_channel_up", "1 while NIXL's side channel (--kv-host:--kv-port) accepts connections, "
           "0 once it stopped (the LM then answers NOT_SERVING); prefill LMs only", ["address"])

Probe = Callable[[], Awaitable[str | None]]
"""One look at the side channel: None while it accepts, else why not."""


async def accepts(host: str, port: int, timeout_s: float) -> str | None:
    """Whether ``host``:``port`` accepts a TCP connection within ``timeout_s``: None if it does (the
    connection is closed at once, nothing sent), else the reason."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), port), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:  # asyncio words a refused connect "Connect call failed": the errno says which
        return os.strerror(e.errno) if e.errno else str(e) or type(e).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class SideChannelWatch:
    """Watches one side channel; see the module docstring. ``probe`` replaces the TCP connect (tests)."""

    def __init__(self, host: str, port: int, on_dead: Callable[[str], Awaitable[None]], *,
                 probe: Probe | None = None, interval_s: float = 5.0, failures: int = 2,
                 timeout_s: float = 2.0) -> None:
        """``failures``: failed probes in a row that mean the listener is gone (a connect can time out
        once on a busy host; a closed port refuses every time)."""
        if failures < 1 or interval_s < 0 or timeout_s <= 0:
            raise ValueError(f"failures must be >= 1, interval_s >= 0 and timeout_s > 0; got {failures}, "
                             f"{interval_s}, {timeout_s}")
        self.address = f"{host}:{port}"
        self.on_dead = on_dead
        self.probe: Probe = probe or (lambda: accepts(host, port, timeout_s))
        self.interval_s, self.failures = interval_s, failures
        self.dead: str | None = None
        """Why the side channel is considered gone; None while it is not."""
        self._task: asyncio.Task | None = None

    async def run(self) -> None:
        """Probes until ``failures`` probes in a row fail, then reports (log, gauge, ``on_dead``) and
        returns. Runs until cancelled while the side channel accepts."""
        UP.labels(self.address).set(1)
        failed = 0
        while True:
            reason = await self.probe()
            failed = failed + 1 if reason is not None else 0
            if failed >= self.failures:
                break
            if reason is not None:
                logger.warning("NIXL's side channel %s did not accept a connection (%s); probing again",
                               self.address, reason)
            await asyncio.sleep(self.interval_s)
        self.dead = reason
        UP.labels(self.address).set(0)
        logger.error("NIXL's side channel %s stopped accepting connections (%s, %d probes in a row): the "
                     "engine's handshake listener is gone and no decode LM can pair with this LM any more; "
                     "marking it NOT_SERVING (restart it)", self.address, reason, failed)
        await self.on_dead(reason)

    def start(self) -> None:
        """Runs ``run`` as a task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="epd-kv-side-channel-watch")

    async def stop(self) -> None:
        """Cancels the watch (the service is stopping); an error it ended with is logged, not raised."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):
            logger.error("the watch of NIXL's side channel %s failed", self.address, exc_info=outcome)
