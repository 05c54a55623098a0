"""Large request bodies parsed off the gateway's event loop, in a helper process.

``json.loads`` of a body at the size limit (86 MiB by default) holds the GIL for hundreds of ms: the C
scanner never releases it, so a thread would not help. On the event loop, every other request (a small
chat of another tenant's) would wait that long behind it. ``ParsePool`` sends a body of at least
``threshold`` bytes (``--parse-offload-mib``) to ``parse_openai`` in a helper process and awaits the
``OpenAICall`` it decides; smaller bodies (the fast path) are parsed inline by ``RequestCore.admit``.

What the helper decides is exactly what the inline parse decides: it runs the same ``parse_openai``
with the same ``GatewayConfig`` and raises the same ``ApiError`` (status, message, type, param; it
pickles whole: ``errors.ApiError.__reduce__``). The gRPC API's raw media never cross: the helper gets a
``MediaRef`` per item and ``parse`` puts the caller's bytes back in their place in ``call.sources``. An
upload API's body is not JSON to scan: it is always parsed inline.

What crossing costs, and why the whole call comes back. The body goes to the helper as a file only
the gateway's user reads, in memory (/dev/shm where there is one): a thread writes it (``os.write``
releases the GIL, the kernel copies), the helper reads it and removes it, and the gateway removes it
too when the parse ends, whatever became of the helper; a body pickled into the executor's queue
instead would be copied holding the GIL (about 100 ms for a limit-size body on a busy 2-core host).
Where no file can be written, it is pickled all the same. The ``OpenAICall`` comes back pickled and
is rebuilt on the executor's manager thread, not the loop: its strings (the data: URLs, base64, so
ASCII) are decoded from UTF-8 on its fast ASCII path, some tens of ms per limit-size body, against
the hundreds the parse takes. Returning less (the media decoded to bytes in the helper) would move
the base64 decode there too, but the media would then be decoded before admission and before the LM
readiness check, which ``RequestCore.admit`` orders before any media work; the decode is pybase64,
off the loop, instead (``fetch.decode_data_url``).

Sharing the host's cores. The helper runs at a lower CPU priority (``os.nice(PARSE_NICE)``): a flood
of big bodies takes the cores the event loops leave, not theirs. At most one body is parsed and
``queued`` more wait for the helper; a further big body waits for a turn here (its body still counted
under the intake budget and its tenant's ``body_mib``, as every body being read or parsed is). A
client that leaves before the helper took its body gives its turn back; one the helper took keeps its
turn until the helper is done with it.

Failure. A helper that dies (killed, out of memory) fails every body it held or had queued with a
503 (``ApiError``, ``server_error``): ``concurrent.futures`` notices the death and fails its futures,
so no parse waits for a dead helper. The first of those bodies to learn of the death starts a new
helper at once, and the next big body goes to it.

Owner: ``server.serve`` creates one per gateway process, ``start()``s it before the listeners open
and ``close()``s it after they stop (the helper is stopped and waited for). ``RequestCore`` holds it.
Buffers: the caller's ``raw`` stays the caller's (the helper works on its own copy, freed when the
parse ends; the file's copy is freed when the helper has read it); the call returned is the caller's,
as an inline parse's is. At most ``1 + queued`` bodies are in files or in the helper at once, each
still charged to its request's lease in the gateway (``BODY_COPIES`` per byte); what the helper holds
while it parses one (the bytes, the parsed objects, the pickled answer: about three copies of that one
body) is outside the budget, bounded by one body per helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import re
import tempfile
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from ectransfer.lockfile import create_held, sweep
from services.common.routes import API
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.request import OpenAICall, parse_openai

logger = logging.getLogger(__name__)

PARSE_NICE = 10
"""How much lower the helper's CPU priority is than the gateway's (``os.nice``): under Linux's
scheduler, a process 10 steps lower gets about a tenth of a core that an event loop also wants."""
QUEUED = 2
"""Bodies that may wait for the helper while it parses one; more wait in ``ParsePool.parse``."""
HELPER_GONE = ("the gateway's body parser stopped while this request was being parsed "
               "(it is restarted); send the request again")


@dataclass(frozen=True)
class MediaRef:
    """Stands in the helper for the gRPC API's raw media item ``index``: ``parse_openai`` only places it
    in ``call.sources``, and ``ParsePool.parse`` puts the item's bytes there."""

    index: int


_CFG: GatewayConfig | None = None
BODY_FILE_PREFIX = "epd-gateway-body-"
"""A body on its way to the helper: ``<dir>/epd-gateway-body-<pid>-<random>`` (``ParsePool.parse``). The
gateway process that wrote it holds its lock until the parse ends (``ectransfer.lockfile``); what a gateway
killed with ``kill -9`` left, the next parse helper's start removes (``ParsePool.start``)."""
BODY_FILE_RE = re.compile(rf"^{BODY_FILE_PREFIX}\d+-[0-9a-f]+$")


def _start_helper(cfg: GatewayConfig, nice: int) -> None:
    """The helper's initializer (in the helper): its lower priority and the gateway's config."""
    global _CFG
    _CFG = cfg
    os.nice(nice)


def _ready() -> int:
    """Runs in the helper once it started (``ParsePool.start`` waits for it): its pid."""
    return os.getpid()


def _write_body(path: str, raw: bytes) -> int:
    """On a thread of the gateway: ``raw`` into a new file only this user reads (``os.write`` releases the
    GIL: the kernel copies, the event loop runs on). Returns its descriptor, which holds the file's lock:
    the caller removes the file, then closes it (``ParsePool._drop``)."""
    fd = create_held(path)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _read_body(path: str) -> bytes:
    """In the helper: the body ``_write_body`` wrote, its file removed once read (the gateway removes it
    too when the parse ends, whatever became of the helper)."""
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read()
    finally:
        _unlink(path)


def _parse(api: str, body: bytes | str, media: int | None, content_type: str) -> OpenAICall:
    """In the helper: ``parse_openai`` of ``body`` (the bytes, or the path of the file that holds them),
    with ``media`` raw items stood in for by ``MediaRef``s."""
    raw = _read_body(body) if isinstance(body, str) else body
    refs = None if media is None else [MediaRef(i) for i in range(media)]
    return parse_openai(api, raw, _CFG, refs, content_type)  # type: ignore[arg-type]


def _call_soon(loop: asyncio.AbstractEventLoop, fn) -> None:
    """``fn`` on ``loop``, from the executor's thread; nothing once the loop is closed (shutdown)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn)


def _body_dir() -> str:
    """Where bodies wait for the helper: memory (/dev/shm) where there is one, else the temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class ParsePool:
    """One helper process parsing large bodies for this gateway process (module docstring)."""

    def __init__(self, cfg: GatewayConfig, threshold: int, queued: int = QUEUED, nice: int = PARSE_NICE) -> None:
        """``threshold``: bodies of at least this many bytes are parsed in the helper (``wants``)."""
        self.cfg, self.threshold, self.nice = cfg, threshold, nice
        self.body_dir = _body_dir()
        self._turns = asyncio.Semaphore(1 + queued)
        self._executor: ProcessPoolExecutor | None = None
        self._held: dict[str, int] = {}
        """Each body file's descriptor (its lock, ``ectransfer.lockfile``) until the file is dropped."""
        self.helper_pid: int | None = None
        """The helper's pid once started (tests, logs)."""

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn: a fork of the gateway would copy its loop, sockets and threads into the helper.
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_helper, initargs=(self.cfg, self.nice))

    async def start(self) -> None:
        """Starts the helper and waits until it runs (its imports are done before the first body); first
        removes the body files no gateway process holds any more (one killed mid-parse left them)."""
        sweep(self.body_dir, BODY_FILE_RE, logger, "gateway body file(s)")
        self._executor = self._new_executor()
        self.helper_pid = await asyncio.wrap_future(self._executor.submit(_ready))
        logger.info("body parser: pid %d, bodies of %d bytes and more (nice +%d)",
                    self.helper_pid, self.threshold, self.nice)

    def wants(self, api: str, raw: bytes) -> bool:
        """Whether ``raw`` is parsed here: a JSON body of at least ``threshold`` bytes."""
        return self._executor is not None and len(raw) >= self.threshold and not API[api].upload

    async def parse(self, api: str, raw: bytes, media: list[bytes] | None = None, content_type: str = "") -> OpenAICall:
        """``parse_openai(api, raw, cfg, media, content_type)``, decided in the helper. Raises what it
        raises (ApiError), or ApiError 503 when the helper died while holding this body."""
        await self._turns.acquire()
        executor, path = self._executor, os.path.join(self.body_dir, f"{BODY_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        try:
            body = await self._send(path, raw)
            if executor is None:
                raise RuntimeError("closed")
            future: Future = executor.submit(_parse, api, body, None if media is None else len(media), content_type)
        except (BrokenProcessPool, RuntimeError):  # broken before this body was sent, or closing
            self._given_back(path)
            await self._replace(executor)
            raise ApiError(503, HELPER_GONE, "server_error", retry_after="1") from None
        except BaseException:  # the client left while its body was written
            self._given_back(path)
            raise
        # The turn is given back when the helper is done with the body, not when a client that left
        # stops waiting: a body it still parses counts against the queue until then.
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda _: _call_soon(loop, functools.partial(self._given_back, path)))
        try:
            call = await asyncio.wrap_future(future)
        except BrokenProcessPool:
            logger.warning("body parser (pid %s) died while parsing a %d-byte body", self.helper_pid, len(raw))
            await self._replace(executor)
            raise ApiError(503, HELPER_GONE, "server_error", retry_after="1") from None
        if media is not None:
            call.sources = [media[s.index] if isinstance(s, MediaRef) else s for s in call.sources]
        return call

    async def _send(self, path: str, raw: bytes) -> bytes | str:
        """What goes to the helper for ``raw``: the path of a file that holds it, written on a thread; or,
        where no file can be written (no room), ``raw`` itself, pickled by the executor's feeder thread (a
        copy made holding the GIL)."""
        write = asyncio.ensure_future(asyncio.to_thread(_write_body, path, raw))
        try:
            self._held[path] = await asyncio.shield(write)  # a client that leaves does not stop the thread
        except asyncio.CancelledError:
            write.add_done_callback(lambda done: self._drop(path, done))  # its file goes after it
            raise
        except OSError as e:
            logger.warning("body parser: a body could not be written to %s (%s); sent pickled", self.body_dir, e)
            return raw
        return path

    def _drop(self, path: str, written: asyncio.Future | None = None) -> None:
        """``path``'s file removed (the helper removes it once read), then its descriptor and lock given up:
        the one held, or the one the abandoned ``written`` returned."""
        _unlink(path)
        fd = self._held.pop(path, None)
        if fd is None and written is not None and not written.cancelled() and written.exception() is None:
            fd = written.result()
        if fd is not None:
            os.close(fd)

    def _given_back(self, path: str) -> None:
        """A body's turn and file given back."""
        self._drop(path)
        self._turns.release()

    async def _replace(self, broken: ProcessPoolExecutor | None) -> None:
        """A new helper in place of ``broken``, once, whichever of its waiters comes first (a closed pool
        stays closed). The new one is in place at once; its process starts before its first body."""
        if broken is None or broken is not self._executor:
            return
        broken.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()
        try:
            self.helper_pid = await asyncio.wrap_future(self._executor.submit(_ready))
        except BrokenProcessPool:  # the next body finds it broken and tries again
            logger.error("body parser could not be restarted")
            return
        logger.info("body parser restarted: pid %d", self.helper_pid)

    async def close(self) -> None:
        """Stops the helper: queued bodies are dropped, the one being parsed is finished, the process
        waited for (on a thread: the loop goes on)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True, cancel_futures=True)
