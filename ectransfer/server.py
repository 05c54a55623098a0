"""The producer end of the Transfer stream (``epd.transfer.v1.TransferService``).

Runs inside the encoder's vLLM engine process, next to the outbound store, on a
``grpc.aio`` server in its own thread (``epd-transfer-server``), so vLLM's
model-runner thread only ever does ``OutboundStore.put``. One stream serves
many items; each Reserve gets its own task (``ectransfer.session``), so a
slow encode never blocks another item's bytes.

Bounded for hostile or broken peers by ``TransferLimits`` (``ectransfer.limits``):
open sessions (streams plus lane connections), outstanding Reserves and queued
bytes per session, in-place hold time, and keepalive pings that end the
session of a peer that vanished. A stream that selects an in-place transport
while the lane listens gets a fresh lane secret in ``Selected``; the lane's
first frame must carry it (single use, forgotten when the stream ends).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import threading
import time

import grpc

from ectransfer import chunkwire, lane
from ectransfer.base import ProducerTransport
from ectransfer.factory import transport_name
from ectransfer.limits import TransferLimits
from ectransfer.outbound import OutboundStore
from ectransfer.protocol import CompatError, check_compat, new_event_loop
from ectransfer.session import Outbox, TransferSession
from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from peerauth import SecurityConfig
from peerauth.refusals import REFUSALS

logger = logging.getLogger(__name__)


MAX_UNPROVEN_LANES = 16  # lane connections still to show their secret (each for at most lane.FIRST_FRAME_S)


class TransferServicer(transfer_pb2_grpc.TransferServiceServicer):
    def __init__(
        self,
        store: OutboundStore,
        compat: transfer_pb2.CompatInfo,
        producer_id: str,
        transports: dict[int, ProducerTransport],
        item_wait_s: float = 60.0,
        stats_fn=None,
        lane: bool = True,
        limits: TransferLimits | None = None,
        widths: dict[str, int] | None = None,
    ) -> None:
        """``widths``: per modality, the engine's measured encoder output width (Stats reports it)."""
        self.stats_fn = stats_fn or store.snapshot
        self.widths = dict(widths or {})
        self.store = store
        self.compat = compat
        self.producer_id = producer_id
        self.transports = transports
        self.item_wait_s = item_wait_s
        self.lane = lane and any(t.in_place for t in transports.values())
        """Offer the same-host control lane with in-place transports (``ectransfer.lane``)."""
        self.lane_address = ""  # set by TransferServerThread once the lane listens
        self.lane_tasks: set[asyncio.Task] = set()  # open lane connections' handlers (cancelled on stop)
        self.limits = limits or TransferLimits()
        self.open_sessions = 0  # Transfer streams and lane connections now open (loop thread only)
        self.sessions: set[TransferSession] = set()  # past the handshake: what the hold sweeper visits
        # Lane secrets of the open streams that offered the lane, each to the
        # transport its stream selected; taken by the one lane connection it opens.
        self._lane_secrets: dict[bytes, int] = {}
        self._unproven_lanes = 0  # lane connections that have not shown a secret yet (loop thread only)
        self.refused_sessions = 0
        self.epoch = f"{producer_id}-{secrets.token_hex(4)}"
        """Names this store's lifetime in Holdings answers (a restarted producer has another)."""

    async def Holdings(self, request, context):
        """What the store holds or keeps (``OutboundStore.identifiers``); without the items when the
        caller's snapshot is current."""
        generation, items = self.store.identifiers()
        if request.epoch == self.epoch and request.generation == generation:
            return transfer_pb2.HoldingsReply(epoch=self.epoch, generation=generation, changed=False)
        return transfer_pb2.HoldingsReply(epoch=self.epoch, generation=generation, changed=True, items=items)

    async def Stats(self, request, context):
        values = {k: float(v) for k, v in self.stats_fn().items() if isinstance(v, (int, float))}
        return transfer_pb2.StatsReply(values=values, encoder_output_widths=self.widths)

    async def _first(self, request_iterator, context, what: str):
        """The stream's next message, or None at its end; a peer that sends
        nothing within ``lane.FIRST_FRAME_S`` is dropped (it would hold a
        session slot for as long as it keeps the connection)."""
        try:
            async with asyncio.timeout(lane.FIRST_FRAME_S):
                return await anext(aiter(request_iterator), None)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no {what} within {lane.FIRST_FRAME_S}s")

    def _admit(self, what: str) -> bool:
        """Counts a new session in, or refuses it (False) at ``max_sessions``."""
        if self.open_sessions >= self.limits.max_sessions:
            self.refused_sessions += 1
            logger.warning("refusing %s: %d sessions open (max_sessions); %d refused so far", what,
                           self.open_sessions, self.refused_sessions)
            return False
        self.open_sessions += 1
        return True

    async def Transfer(self, request_iterator, context):
        # The Hello is read before a refusal: a status sent while the consumer
        # still writes its first message reaches it as INTERNAL, not as the reason.
        first = await self._first(request_iterator, context, "Hello")
        if not self._admit(f"a Transfer stream from {context.peer()}"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this encoder already serves {self.limits.max_sessions} Transfer sessions")
        secret = b""
        try:
            if first is None or first.WhichOneof("msg") != "hello":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Transfer message must be Hello")
            hello = first.hello
            try:
                check_compat(self.compat, hello.compat)
            except CompatError as e:
                logger.warning("refusing consumer %s: %s", hello.consumer_id, e)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            offers = [self.transports[k].offer() for k in hello.transports if k in self.transports]
            challenge = secrets.token_bytes(16)  # this stream's: a proof made for another is worthless here
            for offer in offers:
                offer.challenge = challenge
                if self.lane_address and self.transports[offer.transport].in_place:
                    offer.control_socket = self.lane_address
            if not offers:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no common transport: consumer allows {_names(hello.transports)}, "
                    f"this encoder offers {_names(self.transports)}",
                )
            yield transfer_pb2.TransferServerMsg(hello=transfer_pb2.HelloReply(
                compat=self.compat, producer_id=self.producer_id, offers=offers,
                chunk_nbytes=getattr(self.transports.get(transfer_pb2.GRPC_CHUNKS), "chunk_nbytes", 0)))
            select = await self._first(request_iterator, context, "Select")
            if select is None:
                return  # a probe-only handshake (the LM service's compatibility check)
            if select.WhichOneof("msg") != "select":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected Select after HelloReply")
            transport = self.transports.get(select.select.transport)
            if transport is None or not transport.verify(select.select.proof, challenge):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"consumer {hello.consumer_id} selected {_names([select.select.transport])} "
                                    "without a valid proof")
            logger.info("consumer %s uses %s", hello.consumer_id, _names([transport.kind]))
            selected = transfer_pb2.Selected(transport=transport.kind)
            if self.lane_address and transport.in_place:
                selected.lane_secret = secret = secrets.token_bytes(32)
                self._lane_secrets[secret] = transport.kind
            yield transfer_pb2.TransferServerMsg(selected=selected)
            out = Outbox(self.limits.max_stream_queued_bytes, self.limits.send_stall_s)
            session = self._open_session(transport, hello.consumer_id, out)
            reader = asyncio.create_task(session.read(request_iterator))
            try:
                while (msg := await out.get()) is not None:
                    yield msg
            finally:
                reader.cancel()
                self._close_session(session)
        finally:
            self._lane_secrets.pop(secret, None)  # unused or used: it opens nothing more
            self.open_sessions -= 1

    async def serve_lane(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One control-lane connection (``ectransfer.lane``): Select whose proof
        is an open stream's lane secret, then the same session as a stream."""
        # Anyone in this network namespace can connect (abstract sockets have no
        # permissions): a connection counts as a session only once its secret
        # proved it; until then it is one of at most MAX_UNPROVEN_LANES.
        if self._unproven_lanes >= MAX_UNPROVEN_LANES:
            writer.close()
            return
        self._unproven_lanes += 1
        session, admitted = None, False
        self.lane_tasks.add(asyncio.current_task())
        try:
            try:
                first = await asyncio.wait_for(
                    lane.read_frame(reader, transfer_pb2.TransferClientMsg, lane.MAX_FIRST_FRAME), lane.FIRST_FRAME_S)
            finally:
                self._unproven_lanes -= 1
            if first is None or first.WhichOneof("msg") != "select":
                return
            kind = self._take_lane_secret(first.select.proof)
            transport = self.transports.get(first.select.transport)
            if kind is None or transport is None or transport.kind != kind:
                REFUSALS.refused("lane_secret", "a control-lane connection")  # counted; logged at a bounded rate
                return
            if not self._admit("a control-lane connection"):
                return
            admitted = True
            writer.write(lane.frame(transfer_pb2.TransferServerMsg(
                selected=transfer_pb2.Selected(transport=transport.kind))))
            session = self._open_session(transport, "lane", lane.FrameOut(
                writer, self.limits.max_stream_queued_bytes, self.limits.send_stall_s))

            async def frames():
                while (msg := await lane.read_frame(reader, transfer_pb2.TransferClientMsg)) is not None:
                    yield msg

            await session.read(frames())
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            logger.debug("control lane closed: %s", e)
        except Exception:
            logger.exception("control lane failed")
        finally:
            if session is not None:
                self._close_session(session)  # what it held is released (the lease restarts)
            self.lane_tasks.discard(asyncio.current_task())
            if admitted:
                self.open_sessions -= 1
            writer.close()  # the consumer sees EOF and fails what was in flight

    def _take_lane_secret(self, proof: bytes) -> int | None:
        """The transport of the open stream whose lane secret ``proof`` is
        (then forgotten: one lane connection per secret), or None."""
        found = None
        for secret in list(self._lane_secrets):  # compare_digest: no early exit on a matching prefix
            if hmac.compare_digest(secret, proof):
                found = secret
        return self._lane_secrets.pop(found) if found is not None else None

    def _open_session(self, transport: ProducerTransport, consumer_id: str, out) -> TransferSession:
        session = TransferSession(self, transport, consumer_id, out)
        self.sessions.add(session)
        return session

    def _close_session(self, session: TransferSession) -> None:
        self.sessions.discard(session)
        session.close()

    def expire_holds(self, now: float | None = None) -> int:
        """Ends in-place holds older than ``max_in_place_hold_s`` in every session
        (the server's sweeper, on the loop thread)."""
        now = time.monotonic() if now is None else now
        return sum(session.expire_holds(now) for session in list(self.sessions))


def _names(kinds) -> str:
    return ", ".join(transport_name(k) for k in kinds) or "none"


class TransferServerThread:
    """Owns the asyncio loop and the grpc.aio server of the Transfer service.

    ``start()`` binds and returns the bound port (port 0 picks a free one);
    ``stop()`` stops the server and the loop. A lease sweeper runs on the same
    loop and frees outbound items nobody acked within the store's TTL.
    """

    def __init__(self, servicer: TransferServicer, host: str, port: int, sweep_s: float = 0.25,
                 security: SecurityConfig | None = None) -> None:
        self.servicer = servicer
        self.security = security or SecurityConfig()
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
        self._server = grpc.aio.server(options=self.servicer.limits.server_options(),
                                       interceptors=self.security.server_interceptors())
        chunkwire.add_transfer_service(self.servicer, self._server)
        self.security.require_for(self.host, f"Transfer server {self.host}:{self.port}")
        self.bound_port = self.security.add_port(self._server, f"{self.host}:{self.port}")
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
            try:
                self.servicer.store.expire()
                self.servicer.expire_holds()
            except Exception:
                logger.exception("lease sweep failed")

    def add_datagram_endpoint(self, address: str, on_datagram) -> None:
        """Receives unix datagrams at ``address`` on this loop and calls
        ``on_datagram(bytes)`` for each (the producer worker's save reports)."""

        class _Proto(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                try:
                    on_datagram(data)
                except Exception:
                    logger.exception("bad report on %r", address)

        async def _open() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(address)
            await asyncio.get_running_loop().create_datagram_endpoint(_Proto, sock=sock)

        asyncio.run_coroutine_threadsafe(_open(), self._loop).result(timeout=5)

    def stop(self, drain_s: float = 1.0) -> None:
        """Stops the server, letting open calls finish for up to ``drain_s``."""
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
                    await asyncio.wait(tasks, timeout=drain_s)
            if self._server is not None:
                await self._server.stop(drain_s)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=drain_s + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
