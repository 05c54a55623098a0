"""The producer end of the Transfer stream (``epd.encoder.v1.TransferService``).

Runs inside the encoder's vLLM engine process, next to the outbound store, on a
``grpc.aio`` server in its own thread (``epd-transfer-server``), so vLLM's
model-runner thread only ever does ``OutboundStore.put``. One stream serves
many items; each Reserve gets its own task, so a slow encode never blocks
another item's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import grpc

from ectransfer.base import ProducerTransport
from ectransfer.outbound import OutboundItem, OutboundStore
from ectransfer.protocol import TRANSFER_GRPC_OPTIONS, CompatError, check_compat, new_event_loop
from ectransfer import chunkwire, lane, tensors
from epd.common.v1 import common_pb2
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

logger = logging.getLogger(__name__)


class TransferServicer(encoder_pb2_grpc.TransferServiceServicer):
    def __init__(
        self,
        store: OutboundStore,
        compat: common_pb2.CompatInfo,
        producer_id: str,
        transports: dict[int, ProducerTransport],
        item_wait_s: float = 60.0,
        released_grace_s: float = 2.0,
        stats_fn=None,
        lane: bool = True,
    ) -> None:
        self.stats_fn = stats_fn or store.snapshot
        self.store = store
        self.compat = compat
        self.producer_id = producer_id
        self.transports = transports
        self.item_wait_s = item_wait_s
        self.released_grace_s = released_grace_s
        self.lane = lane and any(t.in_place for t in transports.values())
        """Offer the same-host control lane with in-place transports (``ectransfer.lane``)."""
        self.lane_address = ""  # set by TransferServerThread once the lane listens
        self.lane_tasks: set[asyncio.Task] = set()  # open lane connections' handlers (cancelled on stop)

    async def Stats(self, request, context):
        values = {k: float(v) for k, v in self.stats_fn().items() if isinstance(v, (int, float))}
        return encoder_pb2.StatsReply(values=values)

    async def Transfer(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("msg") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Transfer message must be Hello")
        hello = first.hello
        try:
            check_compat(self.compat, hello.compat)
        except CompatError as e:
            logger.warning("refusing consumer %s: %s", hello.consumer_id, e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        offers = [self.transports[k].offer() for k in hello.transports if k in self.transports]
        for offer in offers:
            if self.lane_address and self.transports[offer.transport].in_place:
                offer.control_socket = self.lane_address
        if not offers:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no common transport: consumer allows {_names(hello.transports)}, "
                f"this encoder offers {_names(self.transports)}",
            )
        yield encoder_pb2.TransferServerMsg(hello=encoder_pb2.HelloReply(
            compat=self.compat, producer_id=self.producer_id, offers=offers,
            chunk_nbytes=getattr(self.transports.get(common_pb2.GRPC_CHUNKS), "chunk_nbytes", 0)))
        select = await anext(aiter(request_iterator), None)
        if select is None:
            return  # a probe-only handshake (the LM service's compatibility check)
        if select.WhichOneof("msg") != "select":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected Select after HelloReply")
        transport = self.transports.get(select.select.transport)
        if transport is None or not transport.verify(select.select.proof):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"consumer {hello.consumer_id} selected {_names([select.select.transport])} "
                                "without a valid proof")
        logger.info("consumer %s uses %s", hello.consumer_id, _names([transport.kind]))
        yield encoder_pb2.TransferServerMsg(selected=encoder_pb2.Selected(transport=transport.kind))
        out: asyncio.Queue = asyncio.Queue()
        session = _Session(self, transport, hello.consumer_id, out)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (msg := await out.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            session.close()

    async def serve_lane(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One control-lane connection (``ectransfer.lane``): Select with a valid
        proof for an in-place transport, then the same session as a stream."""
        session = None
        self.lane_tasks.add(asyncio.current_task())
        try:
            first = await asyncio.wait_for(
                lane.read_frame(reader, encoder_pb2.TransferClientMsg, lane.MAX_FIRST_FRAME), lane.FIRST_FRAME_S)
            if first is None or first.WhichOneof("msg") != "select":
                return
            transport = self.transports.get(first.select.transport)
            if transport is None or not transport.in_place or not transport.verify(first.select.proof):
                logger.warning("refusing a control-lane connection without a valid proof")
                return
            writer.write(lane.frame(encoder_pb2.TransferServerMsg(
                selected=encoder_pb2.Selected(transport=transport.kind))))
            session = _Session(self, transport, "lane", lane.FrameOut(writer))

            async def frames():
                while (msg := await lane.read_frame(reader, encoder_pb2.TransferClientMsg)) is not None:
                    yield msg

            await session.read(frames())
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            logger.debug("control lane closed: %s", e)
        except Exception:  # noqa: BLE001 - one broken connection must not touch the others
            logger.exception("control lane failed")
        finally:
            if session is not None:
                session.close()  # what it held is released (the lease restarts)
            self.lane_tasks.discard(asyncio.current_task())
            writer.close()  # the consumer sees EOF and fails what was in flight

    async def _serve_item(self, reserve: encoder_pb2.Reserve, transport: ProducerTransport, out: asyncio.Queue,
                          pinned: dict[str, OutboundItem]) -> None:
        ident = reserve.identifier
        item = await self._wait_for(ident)
        if item is _GONE:
            await out.put(_error(ident, encoder_pb2.ItemError.NOT_FOUND,
                                 f"item {ident} was freed after another consumer's ack and no new copy is being "
                                 f"encoded here; ask the encoder again"))
            return
        if item is None:
            failed = self.store.failure(ident)
            await out.put(_error(ident, encoder_pb2.ItemError.INTERNAL, f"item {ident}: {failed}") if failed else
                          _error(ident, encoder_pb2.ItemError.TIMED_OUT,
                                 f"item {ident} was not encoded here within {self.item_wait_s}s"))
            return
        item = self.store.begin_send(ident)
        if item is None:  # freed between ready and now (lease or another consumer's ack)
            await out.put(_error(ident, encoder_pb2.ItemError.NOT_FOUND, f"item {ident} is no longer held here"))
            return
        try:
            nbytes = item.slot.nbytes
            if nbytes > reserve.max_nbytes:
                await out.put(_error(ident, encoder_pb2.ItemError.TOO_LARGE,
                                     f"item {ident} has {nbytes} bytes, consumer reserved {reserve.max_nbytes}"))
                return
            data = self.store.view(item)
            desc = common_pb2.TensorDescriptor(
                shape=list(item.shape), dtype=tensors.dtype_to_proto(item.dtype), nbytes=nbytes
            )
            transport.describe(data, desc)
            if transport.in_place:
                previous = pinned.pop(ident, None)
                pinned[ident] = item  # held for the consumer's in-place read, until Ack/Cancel
                item = previous  # an earlier pin of this item on this stream is dropped below
            await out.put(encoder_pb2.TransferServerMsg(header=encoder_pb2.ItemHeader(identifier=ident, tensor=desc)))
            for msg in transport.payload(ident, data):
                await out.put(msg)
                await asyncio.sleep(0)  # let other items interleave
        finally:
            if item is not None:
                self.store.end_send(item)

    async def _wait_for(self, ident: str) -> OutboundItem | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        on_loop = threading.get_ident()

        def ready(item: OutboundItem) -> None:
            if threading.get_ident() == on_loop:  # already in the store: no wake-up needed
                fut.done() or fut.set_result(item)
            else:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(item))

        self.store.on_ready(ident, ready)
        if fut.done():
            self.store.forget_waiter(ident, ready)
            return fut.result()
        deadline = loop.time() + self.item_wait_s
        try:
            while (remaining := deadline - loop.time()) > 0:
                # An item freed lately with no new copy reserved (a second LM asking
                # just after the first one's ack) gets a short grace, not the full
                # wait: the encode that would re-publish it is normally reserved
                # within milliseconds, and otherwise the consumer should fail fast
                # so the gateway can re-encode.
                gone = self.store.released_lately(ident)
                # asyncio.wait on the future itself: no task per item, nothing cancelled.
                await asyncio.wait((fut,), timeout=min(remaining, self.released_grace_s) if gone else remaining)
                if fut.done():
                    return fut.result()
                if gone and self.store.released_lately(ident):
                    return _GONE
            return None
        finally:
            self.store.forget_waiter(ident, ready)


_GONE = object()  # _wait_for: freed lately, no new copy coming


class _Session:
    """The item half of one consumer's Transfer stream (gRPC or control lane):
    Reserve starts a serve task, Ack/Cancel release. ``out.put`` carries the
    producer's messages (``None`` ends the stream). In-place transports (shm,
    CUDA IPC): the consumer reads the slot itself after the header, so the
    session holds (``pinned``) it until that consumer's Ack or Cancel, and
    ``close`` drops what is still held (the lease restarts)."""

    def __init__(self, servicer: TransferServicer, transport: ProducerTransport, consumer_id: str, out) -> None:
        self.servicer = servicer
        self.store = servicer.store
        self.transport = transport
        self.consumer_id = consumer_id
        self.out = out
        self.tasks: dict[str, asyncio.Task] = {}
        self.pinned: dict[str, OutboundItem] = {}

    async def read(self, messages) -> None:
        async for msg in messages:
            kind = msg.WhichOneof("msg")
            if kind == "reserve":
                r = msg.reserve
                # A Reserve for an item being served is a duplicate; one whose last
                # serve has ended (sent, or answered with an error) is a new ask.
                if r.identifier not in self.tasks or self.tasks[r.identifier].done():
                    self.tasks[r.identifier] = asyncio.create_task(
                        self.servicer._serve_item(r, self.transport, self.out, self.pinned))
            elif kind in ("ack", "cancel"):
                ident = getattr(msg, kind).identifier
                task = self.tasks.pop(ident, None)
                if task is not None and not task.done():
                    task.cancel()
                held = self.pinned.pop(ident, None)
                # An in-place reader's Ack/Cancel is for the copy it read, not a
                # newer one published under the same id since.
                self.store.release(ident, kind, held)
                if held is not None:
                    self.store.end_send(held)  # frees the slot if nobody else reads it
            else:
                logger.warning("consumer %s sent an unexpected %s", self.consumer_id, kind)
        await self.out.put(None)  # the consumer half-closed: finish the stream

    def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        for held in self.pinned.values():  # the consumer went away without acking
            self.store.end_send(held, restart_lease=True)
        self.pinned.clear()


def _names(kinds) -> str:
    from ectransfer.factory import transport_name

    return ", ".join(transport_name(k) for k in kinds) or "none"


def _error(ident: str, code: int, message: str) -> encoder_pb2.TransferServerMsg:
    return encoder_pb2.TransferServerMsg(error=encoder_pb2.ItemError(identifier=ident, code=code, message=message))


class TransferServerThread:
    """Owns the asyncio loop and the grpc.aio server of the Transfer service.

    ``start()`` binds and returns the bound port (port 0 picks a free one);
    ``stop()`` stops the server and the loop. A lease sweeper runs on the same
    loop and frees outbound items nobody acked within the store's TTL.
    """

    def __init__(self, servicer: TransferServicer, host: str, port: int, sweep_s: float = 0.25) -> None:
        self.servicer = servicer
        self.host = host
        self.port = port
        self.sweep_s = sweep_s
        self.bound_port: int | None = None
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="epd-transfer-server", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: grpc.aio.Server | None = None
        self._lane: asyncio.AbstractServer | None = None

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"transfer server failed to bind {self.host}:{self.port}") from self._error
        assert self.bound_port is not None
        return self.bound_port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._server = grpc.aio.server(options=TRANSFER_GRPC_OPTIONS)
        chunkwire.add_transfer_service(self.servicer, self._server)
        self.bound_port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.bound_port:
            raise OSError(f"cannot bind {self.host}:{self.port}")
        await self._server.start()
        self._lane = None
        if self.servicer.lane:
            address = lane.new_address()
            try:
                self._lane = await lane.listen(address, self.servicer.serve_lane)
                self.servicer.lane_address = address
            except OSError as e:  # best effort: consumers keep the gRPC stream
                logger.warning("no same-host control lane (%s); items travel on the gRPC stream", e)
                self.servicer.lane = False
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.servicer.store.expire()

    def add_datagram_endpoint(self, address: str, on_datagram) -> None:
        """Receives unix datagrams at ``address`` on this loop and calls
        ``on_datagram(bytes)`` for each (the producer worker's save reports)."""

        class _Proto(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                try:
                    on_datagram(data)
                except Exception:  # noqa: BLE001 - one bad report must not stop the endpoint
                    logger.exception("bad report on %r", address)

        async def _open() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(address)
            await asyncio.get_running_loop().create_datagram_endpoint(_Proto, sock=sock)

        asyncio.run_coroutine_threadsafe(_open(), self._loop).result(timeout=5)

    def stop(self, grace: float = 1.0) -> None:
        if not self._thread.is_alive():
            return

        async def _stop() -> None:
            self._sweeper.cancel()
            if self._lane is not None:
                self._lane.close()
                tasks = list(self.servicer.lane_tasks)
                for t in tasks:  # each handler's finally releases its session and closes its connection
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=grace)
            if self._server is not None:
                await self._server.stop(grace)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=grace + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
