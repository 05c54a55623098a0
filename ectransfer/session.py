"""One consumer's Transfer session on the producer: the item half of a gRPC
Transfer stream or of a control-lane connection (``ectransfer.lane``).

Owner: ``TransferServicer`` (``ectransfer.server``) makes one per stream or
lane connection once the handshake is done, on the Transfer server's loop
thread, and calls ``close`` when the stream ends; everything here runs on that
loop. A session owns, and frees on ``close``:

- ``tasks``: one serve task per outstanding Reserve; a task leaves the dict
  when it ends. Tasks plus holds are bounded by
  ``TransferLimits.max_reserves_per_session``; a Reserve beyond it is answered
  with ``ItemError.RESOURCE_EXHAUSTED``.
- ``holds``: items a consumer reads in place (shm, CUDA IPC) after their
  header, each counted as a reader of its slot (``OutboundStore.begin_send``)
  until the consumer's Ack or Cancel, ``close`` (the lease restarts: the
  consumer may still be copying) or ``max_in_place_hold_s`` (``expire_holds``,
  from the server's sweeper; the lease restarts too).
- ``out``: where the producer's messages go, bounded in bytes: an ``Outbox``
  that the gRPC handler drains, or a ``lane.FrameOut``. A serve task that
  cannot queue within ``send_stall_s`` (``StreamStalled``) gives its item up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from ectransfer import tensors
from ectransfer.base import ProducerTransport
from ectransfer.limits import StreamStalled, TransferLimits
from ectransfer.outbound import OutboundItem, OutboundStore
from epd.transfer.v1 import transfer_pb2

logger = logging.getLogger(__name__)


class Outbox:
    """The producer's messages for one gRPC Transfer stream, at most
    ``max_bytes`` of them queued (always at least one message). The handler
    ``get``s one and yields it; grpc.aio's write completes only as HTTP/2 flow
    control lets it, so a consumer that stops reading stops the queue from
    draining and ``put`` waits: no whole item is ever queued for a stream that
    does not read. ``put(None)`` ends the stream."""

    def __init__(self, max_bytes: int, stall_s: float) -> None:
        self.max_bytes = max_bytes
        self.stall_s = stall_s
        self.queued_bytes = 0
        self._queue: deque[tuple[object, int]] = deque()
        self._ready = asyncio.Event()  # something is queued
        self._room = asyncio.Event()  # something was taken since the last full check

    async def put(self, msg) -> None:
        n = _size(msg)
        if self.queued_bytes and self.queued_bytes + n > self.max_bytes:
            try:
                async with asyncio.timeout(self.stall_s):
                    while self.queued_bytes and self.queued_bytes + n > self.max_bytes:
                        self._room.clear()
                        await self._room.wait()
            except TimeoutError:
                raise StreamStalled(f"{self.queued_bytes} bytes unread for {self.stall_s}s") from None
        self.queued_bytes += n
        self._queue.append((msg, n))
        self._ready.set()

    async def get(self):
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        msg, n = self._queue.popleft()
        self.queued_bytes -= n
        self._room.set()
        return msg


def _size(msg) -> int:
    if msg is None:
        return 0
    return len(msg) if isinstance(msg, bytes) else msg.ByteSize()


MAX_IDENTIFIER_LEN = 256  # vLLM's mm_hash is 64 hex characters
MAX_CLAIM_LEN = 64  # ectransfer.connector.metadata.MAX_CLAIM_LEN (the encoder's are 32)


@dataclass
class _Hold:
    item: OutboundItem
    claim: str
    since: float  # time.monotonic() when the header was queued


class TransferSession:
    def __init__(self, servicer, transport: ProducerTransport, consumer_id: str, out) -> None:
        self.servicer = servicer
        self.store: OutboundStore = servicer.store
        self.limits: TransferLimits = servicer.limits
        self.transport = transport
        self.consumer_id = consumer_id
        self.out = out
        self.tasks: dict[str, tuple[asyncio.Task, str]] = {}  # identifier -> (serving task, its claim)
        self.holds: dict[str, _Hold] = {}  # identifier -> the copy read in place until Ack/Cancel
        self.refused = 0  # Reserves answered RESOURCE_EXHAUSTED
        self.oversized = 0  # messages dropped for an oversized identifier or claim

    @property
    def outstanding(self) -> int:
        """Reserves this session holds resources for (an item being sent and
        held at once counts twice for that moment)."""
        return len(self.tasks) + len(self.holds)

    async def read(self, messages) -> None:
        async for msg in messages:
            kind = msg.WhichOneof("msg")
            body = getattr(msg, kind) if kind in ("reserve", "ack", "cancel") else None
            if body is not None and (len(body.identifier) > MAX_IDENTIFIER_LEN or len(body.claim) > MAX_CLAIM_LEN):
                # Remembered settled claims hold these strings: a peer may not make them large.
                self.oversized += 1
                if self.oversized == 1 or self.oversized % 1000 == 0:
                    logger.warning("consumer %s sent %d %s(s) with an identifier over %d or a claim over %d "
                                   "characters; dropped", self.consumer_id, self.oversized, kind,
                                   MAX_IDENTIFIER_LEN, MAX_CLAIM_LEN)
                if kind == "reserve":
                    await self._put(error(body.identifier[:MAX_IDENTIFIER_LEN], transfer_pb2.ItemError.NOT_FOUND,
                                          "identifier or claim too long"))
                continue
            if kind == "reserve":
                await self._reserve(msg.reserve)
            elif kind in ("ack", "cancel"):
                self._release(getattr(msg, kind), kind)
            else:
                logger.warning("consumer %s sent an unexpected %s", self.consumer_id, kind)
        await self._put(None)  # the consumer half-closed: finish the stream

    async def _reserve(self, r: transfer_pb2.Reserve) -> None:
        # A Reserve for an item being served is a duplicate; one whose last
        # serve has ended (sent, or answered with an error) is a new ask.
        running = self.tasks.get(r.identifier)
        if running is not None and not running[0].done():
            return
        if self.outstanding >= self.limits.max_reserves_per_session:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("request %s: consumer %s has %d outstanding Reserves (max_reserves_per_session); "
                               "refused item %s (%d refused on this stream)", r.request_id, self.consumer_id,
                               self.outstanding, r.identifier, self.refused)
            await self._put(error(r.identifier, transfer_pb2.ItemError.RESOURCE_EXHAUSTED,
                                  f"the encoder already serves {self.limits.max_reserves_per_session} items "
                                  "to this stream; ask again once some are acked"))
            return
        task = asyncio.create_task(self._serve(r))
        self.tasks[r.identifier] = (task, r.claim)
        task.add_done_callback(functools.partial(self._task_done, r.identifier))

    def _task_done(self, ident: str, task: asyncio.Task) -> None:
        running = self.tasks.get(ident)
        if running is not None and running[0] is task:
            del self.tasks[ident]

    def _release(self, msg, kind: str) -> None:
        """Ack or Cancel: settles the claim it names. The serve or in-place hold of
        this stream for that claim ends; another claim's is left alone."""
        ident, claim = msg.identifier, msg.claim
        running = self.tasks.get(ident)
        if running is not None and running[1] == claim:
            del self.tasks[ident]
            if not running[0].done():
                running[0].cancel()
        hold = self.holds.get(ident)
        if hold is not None and hold.claim == claim:
            del self.holds[ident]
        else:
            hold = None
        if kind == "ack":
            self.store.ack(ident, claim, msg.copy)
        else:
            self.store.cancel(ident, claim)
        if hold is not None:
            self.store.end_send(hold.item)  # frees the slot if nothing else holds it

    async def _put(self, msg) -> bool:
        """Queues a message that is not part of an item's bytes (an error);
        False, with a log line, if the consumer has stopped reading."""
        try:
            await self.out.put(msg)
            return True
        except StreamStalled as e:
            logger.warning("consumer %s stopped reading (%s); a message was dropped", self.consumer_id, e)
            return False

    async def _serve(self, reserve: transfer_pb2.Reserve) -> None:
        ident, claim = reserve.identifier, reserve.claim
        item = await wait_for_item(self.store, ident, claim, self.servicer.item_wait_s)
        if item is GONE:
            await self._put(error(ident, transfer_pb2.ItemError.NOT_FOUND,
                                  f"item {ident}: this claim was settled (acked, cancelled, or its encode was "
                                  f"aborted) and its copy freed; ask the encoder again"))
            return
        if item is None:
            failed = self.store.failure(ident)
            await self._put(error(ident, transfer_pb2.ItemError.INTERNAL, f"item {ident}: {failed}") if failed else
                            error(ident, transfer_pb2.ItemError.TIMED_OUT,
                                  f"item {ident} was not encoded here within {self.servicer.item_wait_s}s"))
            return
        item = self.store.begin_send(ident, claim)
        if item is None:  # freed between ready and now (the lease, or this claim cancelled meanwhile)
            await self._put(error(ident, transfer_pb2.ItemError.NOT_FOUND, f"item {ident} is no longer held here"))
            return
        hold = None
        try:
            nbytes = item.slot.nbytes
            if nbytes > reserve.max_nbytes:
                await self._put(error(ident, transfer_pb2.ItemError.TOO_LARGE,
                                      f"item {ident} has {nbytes} bytes, consumer reserved {reserve.max_nbytes}"))
                return
            data = self.store.view(item)
            desc = transfer_pb2.TensorDescriptor(
                shape=list(item.shape), dtype=tensors.dtype_to_proto(item.dtype), nbytes=nbytes
            )
            self.transport.describe(data, desc)
            if self.transport.in_place:
                previous = self.holds.pop(ident, None)
                if previous is not None:  # an earlier hold of this item on this stream
                    self.store.end_send(previous.item)
                hold = self.holds[ident] = _Hold(item, claim, time.monotonic())  # until Ack/Cancel
            await self.out.put(transfer_pb2.TransferServerMsg(header=transfer_pb2.ItemHeader(
                identifier=ident, tensor=desc, copy=item.copy)))
            for msg in self.transport.payload(ident, data):
                await self.out.put(msg)
                await asyncio.sleep(0)  # let other items interleave
        except StreamStalled as e:
            logger.warning("request %s: consumer %s stopped reading (%s); item %s given up", reserve.request_id,
                           self.consumer_id, e, ident)
            if hold is not None and self.holds.get(ident) is hold:
                del self.holds[ident]  # its header never went out: nobody reads it
                hold = None
        finally:
            if hold is None:
                self.store.end_send(item)

    def expire_holds(self, now: float) -> int:
        """Ends in-place holds older than ``max_in_place_hold_s`` (a consumer
        that stopped without closing its stream); returns how many."""
        old = [i for i, h in self.holds.items() if now - h.since > self.limits.max_in_place_hold_s]
        for ident in old:
            hold = self.holds.pop(ident)
            logger.warning("consumer %s held item %s in place for over %.0fs without Ack or Cancel; "
                           "its hold ends (the lease restarts)", self.consumer_id, ident,
                           self.limits.max_in_place_hold_s)
            self.store.end_send(hold.item, lost=True)
        return len(old)

    def close(self) -> None:
        for t, _ in self.tasks.values():
            t.cancel()
        for hold in self.holds.values():  # the consumer went away without acking
            self.store.end_send(hold.item, lost=True)
        self.holds.clear()


def error(ident: str, code: int, message: str) -> transfer_pb2.TransferServerMsg:
    return transfer_pb2.TransferServerMsg(error=transfer_pb2.ItemError(identifier=ident, code=code, message=message))


GONE = object()  # wait_for_item: the claim was settled, no copy is held for it


async def wait_for_item(store: OutboundStore, ident: str, claim: str, wait_s: float):
    """The held copy of ``ident`` (claimed for ``claim``) once there is one; None
    after ``wait_s`` or when it is marked failed; ``GONE`` at once when ``claim``
    was settled for it (acked, cancelled, or its encode aborted) and no copy is held."""
    if store.settled(ident, claim) and not store.contains(ident):
        return GONE
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    on_loop = threading.get_ident()

    def ready(item: OutboundItem | None) -> None:
        if threading.get_ident() == on_loop:  # already in the store: no wake-up needed
            fut.done() or fut.set_result(item)
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(item))

    store.on_ready(ident, claim, ready)
    try:
        # asyncio.wait on the future itself: no task per item, nothing cancelled.
        await asyncio.wait((fut,), timeout=wait_s)
        return fut.result() if fut.done() else None
    finally:
        store.forget_waiter(ident, ready)
