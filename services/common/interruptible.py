"""Blocking media work (decoding, container parsing) that stops when its request does.

A decode runs in a thread (it blocks and holds the GIL in C for stretches), and a Python thread
cannot be killed. ``DecodeThreads`` runs each job on its own short-lived thread and, when the
awaiting request is cancelled (the client went away) or the job outlives its deadline, raises
``DecodeCancelled`` inside that thread (``PyThreadState_SetAsyncExc``): it fires at the thread's
next Python instruction. vLLM's video loaders read a clip frame by frame in Python, so a video
decode stops within one frame; a single C call (PIL decoding one image, libsndfile reading one
clip) finishes first, and those are bounded by the header checks that precede them.

Owner: each service's ``MediaDecoder`` (services.common.media) holds one, used on its event loop.
At most ``n`` jobs run at once; a slot is given back when the job's thread has really ended, so a
stopped decode still counts until it stops.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_NAMES = itertools.count()


class DecodeCancelled(BaseException):
    """Raised inside a decode thread to stop it. A BaseException, so a decoder's own
    ``except Exception`` cannot swallow it (its ``finally`` blocks still run)."""


class _Job:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tid: int | None = None
        self.stopped = False

    def interrupt(self) -> None:
        """Stops the job: before it starts (it then never runs) or while it runs."""
        with self.lock:
            self.stopped = True
            if self.tid is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), ctypes.py_object(DecodeCancelled))


class DecodeThreads:
    """At most ``n`` blocking jobs at once, each stopped when its caller stops waiting."""

    def __init__(self, n: int, name: str = "epd-decode") -> None:
        self.n, self.name = n, name
        self._slots: asyncio.Semaphore | None = None
        self.running = 0

    async def run(self, job: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """``job()``'s result. Raises what it raises; TimeoutError after ``timeout_s`` and
        CancelledError when the caller is cancelled, the job's thread stopped either way."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.n)  # on the loop that uses it
        slots = self._slots
        await slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        state = _Job()

        def settle(result: Any, error: BaseException | None) -> None:
            self.running -= 1
            slots.release()
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def target() -> None:
            result, error = None, None
            try:
                try:
                    with state.lock:
                        if state.stopped:
                            raise DecodeCancelled
                        state.tid = threading.get_ident()
                    result = job()
                finally:
                    with state.lock:
                        state.tid = None
            except DecodeCancelled:
                error = asyncio.CancelledError()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                error = e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting
                pass

        self.running += 1
        threading.Thread(target=target, name=f"{self.name}-{next(_NAMES)}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except BaseException:
            if not done.done():
                state.interrupt()
                done.cancel()
            raise
