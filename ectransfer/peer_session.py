"""One consumer's session with one encoder: the consumer end of a Transfer
stream (``PeerSession``), the handshake (``negotiate``) and the checks on what
the producer sends (``check_header``).

Runs on the transfer client's loop thread (``epd-transfer-client``,
``ectransfer.client``). Buffers: the caller allocates each destination (an
inbound-staging slot) before ``TransferClient.fetch`` and keeps owning it; the
session only writes into it.

The producer is not trusted: an ItemHeader must match what the caller expects
(``check_header``: exactly the promised shape and dtype, ``nbytes`` equal to
both and to the destination) and an in-place item must lie in the segment or
pool that producer proved in its handshake, inside this process's mapping
(``ConsumerTransport.check_source``). A header that does not fails its item
(and the producer is told to let go); it never reaches the caller's reader.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from ectransfer import chunkwire, lane, tensors
from ectransfer.base import ConsumerTransport, Receiver
from ectransfer.chunkwire import LEGACY_TRANSFER_SERVICE, TRANSFER_SERVICE
from ectransfer.protocol import (
    TRANSFER_GRPC_OPTIONS,
    CompatError,
    ItemTransfer,
    ProtocolError,
    TransferState,
    call_status,
    check_compat,
)
from ectransfer.selection import Choice, choose
from epd.transfer.v1 import transfer_pb2


class SessionOwner(Protocol):
    """What a ``PeerSession`` reads of the client that made it (``client.TransferClient``), and the two
    things it reports back: the transport a peer chose, and that a peer's stream closed."""

    compat: Any
    consumer_id: str
    lane: bool
    security: Any
    transports: list[ConsumerTransport]

    def chosen(self, endpoint: str, transport: str) -> None: ...

    def peer_closed(self, peer: PeerSession, error: str) -> None: ...

logger = logging.getLogger(__name__)


@dataclass
class Fetch:
    """One item in flight. ``dest`` belongs to the caller (inbound staging)."""

    transfer: ItemTransfer
    endpoint: str
    dest: torch.Tensor  # flat uint8, exactly the expected nbytes
    deadline: float
    expect_shape: tuple[int, ...] | None = None
    """What the item's metadata promised (``[num_embeds, embed_width]``);
    None: any shape whose bytes fill ``dest``."""
    expect_dtype: torch.dtype | None = None
    """What the item's metadata promised; None: any dtype."""
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    receiver: Receiver | None = None
    in_place: bool = False
    """Asked for: with an in-place transport (shm, CUDA IPC), LANDED means the
    bytes are readable where ``source`` says, held by the producer until the
    caller's ``TransferClient.ack``; ``dest`` is not written."""
    source: transfer_pb2.TensorDescriptor | None = None
    """Set when the item landed in place: the producer's segment/handle and offset."""
    transport: ConsumerTransport | None = None
    """Set with ``source``: the transport that reads it (``where``, ``load``)."""
    claim: str = ""
    """The claim named in Reserve, Ack and Cancel (ItemSource.claim, from the encoder's Encode call)."""
    copy: int = 0
    """The producer's copy number from the ItemHeader (0 until it arrives)."""


class PeerSession:
    """This consumer's session with one encoder endpoint: the Transfer stream
    (and its control lane) and the items asked of it. Made by ``TransferClient``
    on its loop thread, where everything here runs; it ends when the stream
    does (``TransferClient.peer_closed`` then fails its items).

    Owns: ``items`` (asked for, not landed), ``located`` (landed in place, not
    acked: the producer holds them for us) and ``mapped`` (producer memory its
    transport read in place, unmapped when the stream closes). The caller owns
    every ``Fetch.dest``; the session only writes into it."""

    def __init__(self, client: SessionOwner, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.ctrl: asyncio.Queue = asyncio.Queue()  # handshake messages
        self.out: asyncio.Queue = asyncio.Queue()   # item messages, sent only after Select
        self.items: dict[str, Fetch] = {}
        self.located: dict[str, Fetch] = {}  # landed in place, not acked yet
        self.transport: ConsumerTransport | None = None  # chosen in the handshake
        self.mapped: set[str] = set()  # the transport's memory (segment or pool id) read in place
        self.proven: transfer_pb2.TransportOffer | None = None  # the offer whose probe this consumer passed
        self.mode: asyncio.Future = asyncio.get_running_loop().create_future()  # "grpc" (the gRPC stream) or "lane"
        self.writer: asyncio.StreamWriter | None = None  # the control lane, once it carries the items
        self.channel = client.security.aio_channel(endpoint, options=TRANSFER_GRPC_OPTIONS)
        self.task = asyncio.create_task(self._run())

    def send(self, msg: transfer_pb2.TransferClientMsg) -> None:
        """An item message (Reserve, Ack, Cancel) to the producer, on the lane
        once it is up, else on the gRPC stream (queued until the handshake)."""
        if self.writer is not None:
            if not self.writer.is_closing():  # closing: the session ends and fails its items anyway
                self.writer.write(lane.frame(msg))
        else:
            self.out.put_nowait(msg)

    async def _requests(self):
        yield transfer_pb2.TransferClientMsg(
            hello=transfer_pb2.Hello(
                compat=self.client.compat,
                consumer_id=self.client.consumer_id,
                transports=[t.kind for t in self.client.transports],
            )
        )
        yield await self.ctrl.get()  # Select
        if await self.mode == "lane":
            return  # the items travel on the lane; this stream has done its part
        while (msg := await self.out.get()) is not None:
            yield msg

    async def _run(self) -> None:
        error = "stream closed"
        call = None
        try:
            call = chunkwire.transfer_call(self.channel)(self._requests())
            choice = await negotiate(call, self.ctrl.put_nowait, self.client.compat, self.client.transports,
                                     channel=self.channel)
            if choice.fell_back:
                logger.warning("transfer from %s uses %s (%s)", self.endpoint, choice.name, "; ".join(choice.skipped))
            self.transport = choice.transport
            self.proven = choice.offer
            self.client.chosen(self.endpoint, choice.name)
            reader = await self._open_lane(choice) if self.client.lane else None
            if reader is None:
                self.mode.set_result("grpc")
                while (msg := await call.read()) is not grpc.aio.EOF:
                    self._on_message(msg)
            else:
                self.mode.set_result("lane")
                await self.channel.close()  # the stream has done its part
                while (msg := await lane.read_frame(reader, transfer_pb2.TransferServerMsg)) is not None:
                    self._on_message(msg)
                error = f"encoder at {self.endpoint}: the control lane closed"
        except grpc.aio.AioRpcError as e:
            code, details = await call_status(call, e)
            error = f"encoder at {self.endpoint}: {code.name}: {details}"
        except (CompatError, ProtocolError) as e:
            error = f"encoder at {self.endpoint}: {e}"
        except asyncio.CancelledError:
            error = "transfer client shutting down"
        except (ConnectionError, OSError) as e:  # the lane broke
            error = f"encoder at {self.endpoint}: control lane: {e}"
        except Exception as e:
            logger.exception("transfer stream to %s failed", self.endpoint)
            error = f"encoder at {self.endpoint}: {e!r}"
        finally:
            if not self.mode.done():
                self.mode.set_result("grpc")
            if self.writer is not None:
                self.writer.close()
            self.client.peer_closed(self, error)
            await self.channel.close()

    async def _open_lane(self, choice: Choice) -> asyncio.StreamReader | None:
        """Moves the item messages to the producer's control lane when the
        chosen transport is in place and the producer offers one; None (and the
        gRPC stream carries on) when it cannot be reached from here."""
        address = choice.offer.control_socket if choice.offer is not None else ""
        if not (choice.transport.in_place and address and choice.lane_secret):
            return None
        writer = None
        try:
            reader, writer = await lane.connect(address)
            writer.write(lane.frame(transfer_pb2.TransferClientMsg(  # proven by this stream's lane secret
                select=transfer_pb2.Select(transport=choice.transport.kind, proof=choice.lane_secret))))
            reply = await asyncio.wait_for(lane.read_frame(reader, transfer_pb2.TransferServerMsg), 5.0)
            if reply is None or reply.WhichOneof("msg") != "selected":
                raise ConnectionError("the producer refused the lane")
        except Exception as e:  # noqa: BLE001 - unreachable, refused, garbage: the gRPC stream carries on
            if writer is not None:
                writer.close()
            logger.warning("transfer from %s: control lane unavailable (%s); items use the gRPC stream",
                           self.endpoint, e or type(e).__name__)
            return None
        except BaseException:  # cancelled (client shutting down)
            if writer is not None:
                writer.close()
            raise
        while not self.out.empty():  # what was queued during the handshake, in order
            writer.write(lane.frame(self.out.get_nowait()))
        self.writer = writer
        return reader

    def _on_message(self, msg: transfer_pb2.TransferServerMsg) -> None:
        kind = msg.WhichOneof("msg")
        body = getattr(msg, kind)
        fetch = self.items.get(body.identifier)
        if fetch is None:
            return  # cancelled meanwhile; late bytes are dropped
        try:
            if kind == "header":
                self._on_header(fetch, body)
            elif kind == "chunk":
                if fetch.receiver is None:
                    raise ProtocolError("chunk before header")
                if fetch.receiver.feed(body):
                    self._landed(fetch)
            elif kind == "error":
                self.finish(fetch, error=f"encoder at {self.endpoint}: {body.message}")
        except ProtocolError as e:
            self.finish(fetch, error=f"encoder at {self.endpoint}: {e}")
            # The producer may hold the slot for us (in place): let it go.
            self.send(cancel_msg(fetch))

    def _on_header(self, fetch: Fetch, header: transfer_pb2.ItemHeader) -> None:
        desc = header.tensor
        fetch.copy = header.copy
        fetch.shape, fetch.dtype = check_header(header, fetch.dest.numel(), fetch.expect_shape, fetch.expect_dtype)
        self.transport.check_source(desc, self.proven)
        if fetch.in_place and self.transport.in_place:
            self.transport.locate(desc)
            fetch.source, fetch.transport = desc, self.transport
            self.mapped.add(self.transport.where(desc)[0])
            self.items.pop(fetch.transfer.identifier, None)
            self.located[fetch.transfer.identifier] = fetch
            fetch.transfer.advance(TransferState.LANDED)  # the caller acks after reading
            return
        fetch.transfer.advance(TransferState.RECEIVING)
        fetch.receiver = self.transport.receiver(desc, fetch.dest)
        if fetch.receiver.complete:
            self._landed(fetch)

    def demote(self, fetch: Fetch) -> None:
        """An in-place item nobody took within ``hold_s`` (its request waits for
        KV space, or for an item of another encoder): copy it into its staging
        destination and ack, so the producer's pool does not stay pinned by a
        queue (two encoders' pools could otherwise hold each other up)."""
        transfer = fetch.transfer
        with transfer.hold():  # the scheduler takes it (LOADING) before or after, never during
            if transfer.state is not TransferState.LANDED or fetch.source is None:
                return
            self.located.pop(transfer.identifier, None)
            try:
                self.transport.receiver(fetch.source, fetch.dest)
            except ProtocolError as e:
                transfer.try_advance(TransferState.LOST, f"encoder at {self.endpoint}: {e}")
                return
            fetch.source = None
        self.send(ack_msg(fetch))

    def _landed(self, fetch: Fetch) -> None:
        # The bytes now sit in our staging: the producer's copy is no longer needed.
        self.send(ack_msg(fetch))
        self.items.pop(fetch.transfer.identifier, None)
        fetch.transfer.advance(TransferState.LANDED)

    def finish(self, fetch: Fetch, error: str) -> None:
        self.items.pop(fetch.transfer.identifier, None)
        fetch.transfer.fail(error)


def ack_msg(fetch: Fetch) -> transfer_pb2.TransferClientMsg:
    return transfer_pb2.TransferClientMsg(ack=transfer_pb2.Ack(
        identifier=fetch.transfer.identifier, claim=fetch.claim, copy=fetch.copy))


def cancel_msg(fetch: Fetch) -> transfer_pb2.TransferClientMsg:
    return transfer_pb2.TransferClientMsg(cancel=transfer_pb2.Cancel(
        identifier=fetch.transfer.identifier, claim=fetch.claim, copy=fetch.copy))


def check_header(header: transfer_pb2.ItemHeader, dest_nbytes: int, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    """The (shape, dtype) of a producer's ItemHeader once it is what the
    consumer expects: exactly ``shape`` and ``dtype`` when given (what the
    item's metadata promised: ``[num_embeds, embed_width]`` and the dtype),
    no negative dimension, and ``nbytes`` equal to product(shape) * itemsize
    and to ``dest_nbytes``. Raises ProtocolError naming the difference: a
    wrong-shaped tensor must never reach vLLM's encoder cache."""
    desc, ident = header.tensor, header.identifier
    try:
        got_dtype = tensors.dtype_from_proto(desc.dtype)
    except ValueError as e:
        raise ProtocolError(f"item {ident}: {e}") from None
    got_shape = tuple(int(d) for d in desc.shape)
    if any(d < 0 for d in got_shape):
        raise ProtocolError(f"item {ident} has shape {list(got_shape)} with a negative dimension")
    if dtype is not None and got_dtype != dtype:
        raise ProtocolError(f"item {ident} has dtype {tensors.dtype_name(got_dtype)}, "
                            f"expected {tensors.dtype_name(dtype)}")
    if shape is not None and got_shape != tuple(shape):
        raise ProtocolError(f"item {ident} has shape {list(got_shape)}, expected {list(shape)}")
    if desc.nbytes != dest_nbytes:
        raise ProtocolError(f"item {ident} has {desc.nbytes} bytes, expected {dest_nbytes}")
    if tensors.nbytes_of(got_shape, got_dtype) != desc.nbytes:
        raise ProtocolError(f"item {ident}: descriptor shape {list(got_shape)} does not match {desc.nbytes} bytes")
    return got_shape, got_dtype


def _older_producer(details: str) -> CompatError:
    return CompatError(f"the producer has no {TRANSFER_SERVICE} ({details}): it runs an older "
                       f"epd-serve (its Transfer service was {LEGACY_TRANSFER_SERVICE}); run one "
                       f"version across the deployment")


async def _service_missing(channel) -> str | None:
    """The details of UNIMPLEMENTED when ``channel``'s server has no
    epd.transfer.v1 (asked with the unary Stats, which no write can race), else None."""
    stats = channel.unary_unary(f"/{TRANSFER_SERVICE}/Stats",
                                request_serializer=transfer_pb2.StatsRequest.SerializeToString,
                                response_deserializer=transfer_pb2.StatsReply.FromString)
    try:
        await stats(transfer_pb2.StatsRequest(), timeout=5)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return e.details()
    return None


async def negotiate(call, send, compat: transfer_pb2.CompatInfo, transports: list[ConsumerTransport],
                    select=None, channel=None) -> Choice:
    """Consumer side of the handshake on an open Transfer ``call`` whose request
    stream already yielded Hello; ``send`` enqueues a client message. Raises
    CompatError or ProtocolError with a message meant for people. ``select``:
    a predicate on the Choice; when false the handshake stops before Select
    (a check that cannot prove the transport itself). ``channel``: the call's
    channel, to tell an older producer apart when grpc hides its answer (below)."""
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # no epd.transfer.v1: a producer from before the move
            raise _older_producer(e.details()) from None
        if e.code() == grpc.StatusCode.INTERNAL and channel is not None:
            # grpc.aio replaces the server's status with INTERNAL "Internal error from Core" when the
            # Hello write loses the race with an UNIMPLEMENTED answer (grpc/grpc#36066): ask again
            # with a unary call, which has no write to lose.
            if (details := await _service_missing(channel)) is not None:
                raise _older_producer(details) from None
        raise
    if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":
        raise ProtocolError("producer did not answer Hello")
    check_compat(compat, first.hello.compat)
    choice = choose(list(first.hello.offers), transports)
    if select is not None and not select(choice):
        return choice
    send(transfer_pb2.TransferClientMsg(select=transfer_pb2.Select(transport=choice.transport.kind, proof=choice.proof)))
    second = await call.read()
    if second is grpc.aio.EOF or second.WhichOneof("msg") != "selected":
        raise ProtocolError("producer did not confirm the transport")
    choice.lane_secret = second.selected.lane_secret
    return choice
