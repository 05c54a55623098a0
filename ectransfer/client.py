"""The consumer end of the Transfer stream: one client per LM engine.

Runs inside the LM's vLLM engine process on its own asyncio loop and thread
(``epd-transfer-client``); the scheduler-side connector calls ``fetch``/
``ack``/``cancel`` from vLLM's scheduler thread and polls each item's
``ItemTransfer.state``. Nothing here blocks the scheduler.

Buffers: the caller allocates the destination (an inbound-staging slot) before
``fetch`` and keeps owning it; the client only writes into it. One session
(``ectransfer.peer_session.PeerSession``) per encoder endpoint, opened lazily,
dropped when its stream breaks (the next fetch reconnects).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from ectransfer.base import ConsumerTransport
from ectransfer.peer_session import Fetch, PeerSession, cancel_msg
from ectransfer.protocol import ItemTransfer, TransferState, new_event_loop
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig

logger = logging.getLogger(__name__)


class TransferClient:
    """Owns the loop thread and one stream per encoder endpoint."""

    def __init__(
        self,
        compat: transfer_pb2.CompatInfo,
        consumer_id: str,
        transports: list[ConsumerTransport],
        timeout_s: float = 30.0,
        hold_s: float = 2.0,
        lane: bool = True,
        security: SecurityConfig | None = None,
    ) -> None:
        self.compat = compat
        self.lane = lane
        self.security = security or SecurityConfig()
        self.hold_s = hold_s
        self.consumer_id = consumer_id
        self.transports = transports
        self.timeout_s = timeout_s
        self._peers: dict[str, PeerSession] = {}
        self._unmapped: list[tuple[str, str]] = []
        self._chosen: dict[str, str] = {}  # endpoint -> transport name, last negotiated
        self._unmapped_lock = threading.Lock()  # client thread appends, scheduler thread takes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> TransferClient:
        """Starts the client's loop thread (once; ``close`` stops it). Returns the client."""
        if self._thread is None:
            self._loop = new_event_loop()
            self._thread = threading.Thread(target=self._run, name="epd-transfer-client", daemon=True)
            self._thread.start()
        return self

    def _call(self, fn, *args) -> None:
        if self._thread is None:
            raise RuntimeError("TransferClient.start() was not called")
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._watchdog_task = self._loop.create_task(self._watchdog())
        self._loop.run_forever()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                try:
                    self._watch(peer, now)
                except Exception:
                    logger.exception("transfer watchdog: peer %s", peer.endpoint)

    def _watch(self, peer: PeerSession, now: float) -> None:
        """Demotes in-place items held too long; fails items with no data in time."""
        landed_before = time.perf_counter() - self.hold_s  # a located item's last transition is LANDED
        for fetch in list(peer.located.values()):
            if fetch.transfer.changed_at < landed_before:
                peer.demote(fetch)
        for fetch in list(peer.items.values()):
            if now > fetch.deadline:
                peer.finish(fetch, f"encoder at {peer.endpoint}: no data within {self.timeout_s}s")
                peer.send(cancel_msg(fetch))

    # -- called from vLLM's scheduler thread --------------------------------

    def fetch(self, transfer: ItemTransfer, endpoint: str, dest: torch.Tensor, request_id: str,
              in_place: bool = False, shape: tuple[int, ...] | None = None,
              dtype: torch.dtype | None = None, claim: str = "") -> Fetch:
        """Asks ``endpoint`` for the item under ``claim``. Bytes land in ``dest`` (acked at
        once), or with ``in_place`` and a transport that can (shm, CUDA IPC)
        stay where the producer holds them until ``ack``. ``shape``/``dtype``:
        what the item must be (its header is refused otherwise)."""
        fetch = Fetch(transfer, endpoint, dest, deadline=time.monotonic() + self.timeout_s, in_place=in_place,
                      expect_shape=None if shape is None else tuple(shape), expect_dtype=dtype, claim=claim)
        self._call(self._start_fetch, fetch, request_id)
        return fetch

    def ack(self, endpoint: str, identifier: str, claim: str = "", copy: int = 0) -> None:
        """The caller has copied an in-place item (copy ``copy``, read for
        ``claim``): the producer may free it."""
        self._call(self._send, endpoint, "ack", identifier, claim, copy)

    def cancel(self, endpoint: str, identifier: str, claim: str = "", copy: int = 0) -> None:
        """The caller will not read the item for ``claim``: the producer settles that claim."""
        self._call(self._send, endpoint, "cancel", identifier, claim, copy)

    def transport_of(self, endpoint: str) -> str:
        """The transport last negotiated with ``endpoint`` ("" if none yet)."""
        return self._chosen.get(endpoint, "")

    def take_unmapped(self) -> list[tuple[str, str]]:
        """(transport name, memory) of producer memory read in place whose
        stream has closed since the last call: readers elsewhere (vLLM's worker;
        the connector, for a transport's ``shared_mappings``) unmap these
        with that transport's ``forget``."""
        with self._unmapped_lock:
            out, self._unmapped = self._unmapped, []
        return out

    def close(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            return

        async def _close() -> None:
            self._watchdog_task.cancel()
            for peer in list(self._peers.values()):
                peer.task.cancel()
            await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # -- loop thread ----------------------------------------------------------

    def _start_fetch(self, fetch: Fetch, request_id: str) -> None:
        peer = self._peers.get(fetch.endpoint)
        if peer is None:
            peer = self._peers[fetch.endpoint] = PeerSession(self, fetch.endpoint)
        peer.items[fetch.transfer.identifier] = fetch
        peer.send(transfer_pb2.TransferClientMsg(reserve=transfer_pb2.Reserve(
            identifier=fetch.transfer.identifier, request_id=request_id, max_nbytes=fetch.dest.numel(),
            claim=fetch.claim)))

    def _send(self, endpoint: str, kind: str, identifier: str, claim: str, copy: int) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = PeerSession(self, endpoint)
        for table in (peer.items, peer.located):  # this claim's fetch is over; another claim's goes on
            fetch = table.get(identifier)
            if fetch is not None and fetch.claim == claim:
                del table[identifier]
        cls = transfer_pb2.Ack if kind == "ack" else transfer_pb2.Cancel
        peer.send(transfer_pb2.TransferClientMsg(**{kind: cls(identifier=identifier, claim=claim, copy=copy)}))

    def chosen(self, endpoint: str, transport: str) -> None:
        """A peer's handshake chose ``transport`` (``transport_of`` reports it)."""
        self._chosen[endpoint] = transport

    def peer_closed(self, peer: PeerSession, error: str) -> None:
        """A peer's stream ended: its items fail, its mappings go (loop thread)."""
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        for fetch in list(peer.items.values()):
            peer.finish(fetch, error)
        # Landed in place, not taken yet: the producer no longer holds it for us
        # (it keeps a released copy a lease longer, but may reuse a live one's
        # slot once another consumer acks), so the caller fails it.
        for fetch in list(peer.located.values()):
            fetch.transfer.try_advance(TransferState.LOST, error)  # not once taken (LOADING); the caller fails it
        peer.located.clear()
        # This thread's shm mappings of the producer go now; readers elsewhere
        # (vLLM's worker, and CUDA mappings, shared process-wide) unmap after
        # their next loads (``take_unmapped``), so a restarted producer's old
        # pool is not kept alive.
        transport = peer.transport
        if transport is not None:
            transport.release(peer.proven)  # what its probe set up for this stream (NIXL: the remote agent)
        if transport is not None and peer.mapped:
            if not transport.shared_mappings:
                for memory in peer.mapped:
                    transport.forget(memory)
            with self._unmapped_lock:
                self._unmapped.extend((transport.name, memory) for memory in peer.mapped)
        if peer.items or error != "stream closed":
            logger.warning("transfer stream to %s closed: %s", peer.endpoint, error)
