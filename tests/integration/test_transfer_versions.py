"""Peers on either side of the Transfer service's move to ``epd.transfer.v1`` meet with a version error
naming both sides, never a bare UNIMPLEMENTED or a hang (docs/protocol.md, "Versioning")."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from ectransfer import chunkwire
from ectransfer.protocol import TransferState, make_compat
from epd.transfer.v1 import transfer_pb2
from tests.support.loopback import Consumer, Producer

pytestmark = pytest.mark.integration

HELLO = transfer_pb2.TransferClientMsg(hello=transfer_pb2.Hello(
    compat=make_compat(vllm_version="0.32.0", model="test-model", dtype="bfloat16", embed_width=128)))


def test_an_old_consumer_is_told_the_producer_is_newer():
    producer = Producer(transports=("grpc",))
    try:
        with grpc.insecure_channel(producer.endpoint) as ch:
            old = ch.stream_stream(f"/{chunkwire.LEGACY_TRANSFER_SERVICE}/Transfer",
                                   request_serializer=transfer_pb2.TransferClientMsg.SerializeToString,
                                   response_deserializer=transfer_pb2.TransferServerMsg.FromString)
            with pytest.raises(grpc.RpcError) as err:
                list(old(iter([HELLO]), timeout=10))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "the consumer runs an older epd-serve" in err.value.details()
            stats = ch.unary_unary(f"/{chunkwire.LEGACY_TRANSFER_SERVICE}/Stats",
                                   request_serializer=transfer_pb2.StatsRequest.SerializeToString,
                                   response_deserializer=transfer_pb2.StatsReply.FromString)
            with pytest.raises(grpc.RpcError) as err:
                stats(transfer_pb2.StatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        producer.close()


class _OldProducer:
    """A server with the Transfer service under its old name only, as an encoder of 0.3 serves it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        async def transfer(request_iterator, context):
            async for _ in request_iterator:
                yield transfer_pb2.TransferServerMsg(hello=transfer_pb2.HelloReply(compat=HELLO.hello.compat))

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            chunkwire.LEGACY_TRANSFER_SERVICE, {"Transfer": grpc.stream_stream_rpc_method_handler(
                transfer, request_deserializer=transfer_pb2.TransferClientMsg.FromString,
                response_serializer=transfer_pb2.TransferServerMsg.SerializeToString)}),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_new_consumer_is_told_the_producer_is_older():
    old = _OldProducer()
    consumer = Consumer(transports=("grpc",), timeout_s=10)
    try:
        transfer, got = consumer.get(f"127.0.0.1:{old.port}", "item-1", 1024)
        assert transfer.state is TransferState.FAILED and got is None
        assert "it runs an older epd-serve" in transfer.error, transfer.error
        assert chunkwire.LEGACY_TRANSFER_SERVICE in transfer.error
    finally:
        consumer.close()
        old.close()


def test_grpc_hiding_the_older_producers_answer_behind_internal_still_names_the_version():
    """grpc.aio may report INTERNAL "Internal error from Core" instead of the server's UNIMPLEMENTED
    when the Hello write loses a race with it (grpc/grpc#36066); the consumer asks again, unary."""
    from ectransfer.peer_session import negotiate
    from ectransfer.protocol import CompatError

    class _HiddenAnswer:
        async def read(self):
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Internal error from Core")

    old, current = _OldProducer(), Producer(transports=("grpc",))
    try:
        async def run():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{old.port}") as ch:
                with pytest.raises(CompatError, match="it runs an older epd-serve"):
                    await negotiate(_HiddenAnswer(), lambda _: None, HELLO.hello.compat, [], channel=ch)
            async with grpc.aio.insecure_channel(current.endpoint) as ch:
                with pytest.raises(grpc.aio.AioRpcError):  # a current producer: the INTERNAL stands
                    await negotiate(_HiddenAnswer(), lambda _: None, HELLO.hello.compat, [], channel=ch)
        asyncio.run(run())
    finally:
        current.close()
        old.close()
