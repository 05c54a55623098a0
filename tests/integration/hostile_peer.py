"""A Transfer consumer driven message by message, for tests of what a broken
or hostile peer can make the producer hold (``test_transfer_hostile.py``).

``RawStream`` speaks the protocol on a real grpc.aio stream, but only what the
test tells it: it may flood Reserves, never read, never ack. ``lane_select``
opens a control-lane connection with a chosen proof. Run as a module it opens
a stream, prints READY and sleeps (a peer to stop with SIGSTOP):

    python -m tests.integration.hostile_peer HOST:PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from ectransfer import chunkwire, factory, lane
from ectransfer.protocol import TRANSFER_GRPC_OPTIONS, call_status
from ectransfer.selection import choose
from epd.transfer.v1 import transfer_pb2
from tests.support.loopback import compat


class RawStream:
    """One Transfer stream. ``open`` runs Hello (and Select unless
    ``select=False``); ``selected`` is the producer's Selected, ``proof`` what
    this peer proved (the shm nonce for ``shm``)."""

    def __init__(self, channel: grpc.aio.Channel, call) -> None:
        self.channel = channel
        self.call = call
        self.hello: transfer_pb2.HelloReply | None = None
        self.selected: transfer_pb2.Selected | None = None
        self.proof = b""
        self.offer: transfer_pb2.TransportOffer | None = None

    @classmethod
    async def open(cls, endpoint: str, transport: str = "grpc", select: bool = True) -> RawStream:
        channel = grpc.aio.insecure_channel(endpoint, options=TRANSFER_GRPC_OPTIONS)
        stream = cls(channel, chunkwire.transfer_call(channel)())
        consumer = factory.make_consumer(transport)
        try:
            await stream.call.write(transfer_pb2.TransferClientMsg(hello=transfer_pb2.Hello(
                compat=compat(), consumer_id="hostile", transports=[consumer.kind])))
        except grpc.aio.AioRpcError:
            pass  # the producer ended the call before reading (refused): read() raises its status
        try:
            reply = await stream.call.read()
        except grpc.aio.AioRpcError as e:  # a refused call's own status (the failed write may surface as INTERNAL)
            code, details = await call_status(stream.call, e)
            raise grpc.aio.AioRpcError(code, e.initial_metadata(), e.trailing_metadata(), details) from None
        stream.hello = reply.hello
        if select:
            choice = choose(list(reply.hello.offers), [consumer])
            stream.proof, stream.offer = choice.proof, choice.offer
            await stream.send(select=transfer_pb2.Select(transport=consumer.kind, proof=choice.proof))
            stream.selected = (await stream.call.read()).selected
        return stream

    async def send(self, **msg) -> None:
        await self.call.write(transfer_pb2.TransferClientMsg(**msg))

    async def reserve(self, ident: str, max_nbytes: int = 1 << 30, claim: str = "") -> None:
        await self.send(reserve=transfer_pb2.Reserve(identifier=ident, request_id=f"r-{ident}", max_nbytes=max_nbytes,
                                                    claim=claim))

    async def cancel(self, ident: str, claim: str = "") -> None:
        await self.send(cancel=transfer_pb2.Cancel(identifier=ident, claim=claim))

    async def read(self, timeout: float = 10.0):
        """The next server message (a ChunkMsg for a chunk), or EOF."""
        return await asyncio.wait_for(self.call.read(), timeout)

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def lane_select(address: str, transport: int, proof: bytes, timeout: float = 30.0):
    """Opens a control-lane connection whose first frame is Select{proof};
    returns the producer's answer (a TransferServerMsg) or None if it closed
    the connection, and the open writer (the caller closes it). ``timeout`` only
    bounds a hang (a refusal closes at once): generous, for a slow, busy host."""
    reader, writer = await lane.connect(address)
    writer.write(lane.frame(transfer_pb2.TransferClientMsg(select=transfer_pb2.Select(transport=transport, proof=proof))))
    try:
        reply = await asyncio.wait_for(lane.read_frame(reader, transfer_pb2.TransferServerMsg), timeout)
    except (ConnectionError, OSError):
        reply = None
    return reply, writer


async def _sleeper(endpoint: str) -> None:
    stream = await RawStream.open(endpoint)
    print("READY", flush=True)
    await asyncio.sleep(3600)
    await stream.close()


if __name__ == "__main__":
    asyncio.run(_sleeper(sys.argv[1]))
