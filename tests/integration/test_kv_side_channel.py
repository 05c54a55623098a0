"""vLLM's own NIXL handshake listener (the function its NixlConnector's scheduler runs on a thread in the
EngineCore, here on a thread of the test, on loopback) beside a real grpc.aio server's health, watched
as a prefill LM watches it (``services.lm.side_channel``): the probes leave it serving
handshakes, and the one malformed message that ends it turns the LM's health NOT_SERVING."""

from __future__ import annotations

import asyncio
import threading

import grpc
import msgspec
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import GrpcServer
from services.lm.side_channel import SideChannelWatch
from services.up import free_port

pytestmark = pytest.mark.integration

nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")
GET_META_MSG = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata").GET_META_MSG

METADATA = b"this engine's NIXL agent metadata"


@pytest.fixture
def listener():
    """vLLM's handshake listener thread on a free loopback port: (thread, port)."""
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=nixl.NixlBaseConnectorScheduler._nixl_handshake_listener,
                              args=({(0, 0): METADATA}, ready, stop, "127.0.0.1", port),
                              daemon=True, name="nixl_handshake_listener")
    thread.start()
    assert ready.wait(30), "vLLM's listener did not bind"
    yield thread, port
    stop.set()
    thread.join(10)


def _send(port: int, frame: bytes) -> list[bytes] | None:
    """``frame`` to the listener as a decode engine's handshake sends it (ZMQ REQ); its answer, or None
    without one within 5 s."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(frame)
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None
    finally:
        ctx.destroy(linger=0)


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return resp.status


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # vLLM's thread dies
def test_a_malformed_handshake_ends_vllms_listener_and_the_lm_answers_not_serving(listener):
    thread, kv_port = listener

    async def main() -> SideChannelWatch:
        server = GrpcServer("127.0.0.1", 0)
        address = f"127.0.0.1:{await server.start()}"
        await server.set_serving(True)
        watch = SideChannelWatch("127.0.0.1", kv_port, on_dead=lambda _why: server.set_serving(False),
                                 interval_s=0.05)
        watch.start()
        try:
            await asyncio.sleep(0.5)  # probes, many of them
            answer = await asyncio.to_thread(_send, kv_port, msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            assert answer is not None and answer[0] == METADATA, "the probes disturbed vLLM's listener"
            assert await _health(address) == health_pb2.HealthCheckResponse.SERVING and watch.dead is None

            assert await asyncio.to_thread(_send, kv_port, b"\xc1 not msgpack") is None
            for _ in range(600):
                if await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
            return watch
        finally:
            await watch.stop()
            await server.stop()

    watch = asyncio.run(asyncio.wait_for(main(), 120))
    assert watch.dead is not None and "refused" in watch.dead.lower()
    assert not thread.is_alive()
