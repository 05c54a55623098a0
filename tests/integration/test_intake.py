"""Request bodies before admission (services.gateway.intake), against a real aiohttp server and a
real grpc.aio server on loopback: oversized bodies refused before they are read, slow uploads cut
off, at most --max-body-readers read at once, every body's bytes held in one budget until its
answer ends, on REST and on the native gRPC API alike."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from aiohttp import web

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_server import GrpcServer
from services.gateway import intake as intake_module
from services.gateway.config import BODY_COPIES, GatewayConfig
from services.gateway.grpc_intake import GrpcIntake
from services.gateway.intake import GRPC_READERS, BodyRefused, Intake
from tests.integration.gateway_fakes import wait_until

pytestmark = pytest.mark.integration


def _cfg(**kw) -> GatewayConfig:
    # Small limits: a 2 MiB body at most (images 0.5 MiB, audio and video 1 MiB). A body timeout that a
    # loopback upload never reaches on a busy host; the tests of the deadline set their own.
    base = dict(lms="lm:1", max_image_bytes=512 << 10, max_audio_bytes=1 << 20, max_video_bytes=1 << 20,
                body_memory_mib=32, body_timeout_s=10.0, max_body_readers=4)
    return GatewayConfig(**{**base, **kw})


@contextlib.asynccontextmanager
async def _rest(intake: Intake, hold: asyncio.Event | None = None):
    """An aiohttp server whose one route reads its body through ``intake`` and answers its size
    (holding the lease until ``hold`` is set, when given)."""

    async def handler(request):
        try:
            raw, lease = await intake.read(request)
        except BodyRefused as e:
            return web.json_response({"error": e.message}, status=e.status)
        try:
            if hold is not None:
                await hold.wait()
            return web.json_response({"bytes": len(raw)})
        finally:
            lease.release()

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _raw(port: int, head: bytes, body_chunks=(), delay: float = 0.0) -> tuple[int, bytes]:
    """Sends a hand-made HTTP request (head, then each chunk after ``delay``) and returns the status
    and the rest of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        for chunk in body_chunks:
            await asyncio.sleep(delay)
            if reader.at_eof():
                break
            writer.write(chunk)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        return int(head.split()[1]), await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


def _head(length: int | None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}Connection: close\r\n\r\n".encode()


def test_a_body_declared_larger_than_the_limit_is_refused_before_it_is_read():
    intake = Intake(_cfg())

    async def main():
        async with _rest(intake) as port:
            # Nothing of the body is sent: the answer comes from the header alone.
            status, rest = await _raw(port, _head(intake.max_body + 1))
        assert status == 413 and b"larger than" in rest
        assert intake.budget.used == 0

    asyncio.run(main())


def test_a_chunked_body_that_grows_past_the_limit_is_refused_and_its_bytes_given_back():
    intake = Intake(_cfg())
    chunk = b"x" * (256 << 10)

    async def main():
        async with _rest(intake) as port:
            chunks = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * (intake.max_body // len(chunk) + 4)
            status, rest = await _raw(port, _head(None), chunks)
        assert status == 413
        assert intake.budget.used == 0 and intake.reading == 0

    asyncio.run(main())


def test_a_slow_upload_is_cut_off_at_the_body_deadline():
    intake = Intake(_cfg(body_timeout_s=0.5))

    async def main():
        async with _rest(intake) as port:
            status, rest = await _raw(port, _head(100), [b"{"] * 12, delay=0.1)
        assert status == 408 and b"--body-timeout-s" in rest
        assert intake.budget.used == 0 and intake.reading == 0

    asyncio.run(main())


def test_a_drip_is_cut_off_by_the_minimum_rate_long_before_the_deadline():
    intake = Intake(_cfg(body_timeout_s=30.0, body_min_rate_kib=16))

    async def main():
        async with _rest(intake) as port:
            t0 = asyncio.get_running_loop().time()
            status, rest = await _raw(port, _head(1 << 20), [b"{"] * 30, delay=0.1)
            took = asyncio.get_running_loop().time() - t0
        assert status == 408 and b"too slowly" in rest and took < 10
        assert intake.budget.used == 0 and intake.reading == 0

    asyncio.run(main())


def test_a_small_body_goes_ahead_of_a_large_one_waiting_for_room(monkeypatch):
    """The body budget is not first come, first served: a waiting 3 x 2 MiB share does not hold
    up a body of a few bytes."""
    # The large body waits for room far longer than the small one can take, so "went ahead" is checked as
    # a state (the large one still waits), not as a time: with the 1 s wait the small one had to be answered
    # within 0.5 s, which a slow, busy host missed.
    monkeypatch.setattr(intake_module, "WAIT_S", 60.0)
    intake = Intake(_cfg())

    async def main():
        async with _rest(intake) as port:
            assert await intake.budget.acquire(intake.budget.capacity - 1024, 1)  # almost full
            big = asyncio.ensure_future(_raw(port, _head(2 << 20), [b"x" * (2 << 20)]))
            while not intake.budget.waiting:
                await asyncio.sleep(0.01)
            status, _ = await _raw(port, _head(2), [b"{}"])
            assert status == 200 and intake.budget.waiting == 1 and not big.done()  # went ahead of the waiter
            intake.budget.release(intake.budget.capacity - 1024)
            assert (await big)[0] == 200  # room again: the waiter goes ahead

    asyncio.run(main())


def test_one_body_more_than_max_body_readers_is_refused_at_once_and_others_still_get_through():
    intake = Intake(_cfg(max_body_readers=2, body_timeout_s=3.0))

    async def main():
        async with _rest(intake) as port:
            drips = [asyncio.ensure_future(_raw(port, _head(10), [b"{"] * 9, delay=0.25)) for _ in range(2)]
            while intake.reading < 2:
                await asyncio.sleep(0.01)
            status, rest = await _raw(port, _head(2), [b"{}"])
            assert status == 503 and b"--max-body-readers" in rest
            await asyncio.gather(*drips)  # both readers finish (their bodies are incomplete: 408)
            status, rest = await _raw(port, _head(2), [b"{}"])
            assert status == 200 and json.loads(rest) == {"bytes": 2}

    asyncio.run(main())


def test_every_body_holds_its_bytes_from_the_budget_until_its_answer_ends():
    # Budget: 3 copies of two 2 MiB bodies, so a third does not fit while two are held.
    cfg = _cfg(body_memory_mib=BODY_COPIES * 2 * 2.1, body_timeout_s=5.0)
    intake, hold = Intake(cfg), asyncio.Event()
    body = b"x" * (2 << 20)

    async def main():
        async with _rest(intake, hold) as port:
            held = [asyncio.ensure_future(_raw(port, _head(len(body)), [body])) for _ in range(2)]
            while intake.budget.used < 2 * BODY_COPIES * len(body):
                await asyncio.sleep(0.01)
            status, rest = await _raw(port, _head(len(body)), [body])
            assert status == 503 and b"--body-memory-mib" in rest
            hold.set()
            assert [s for s, _ in await asyncio.gather(*held)] == [200, 200]
            assert intake.budget.used == 0
            status, _ = await _raw(port, _head(len(body)), [body])
            assert status == 200

    asyncio.run(main())


class _Echo(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.held: list[int] = []

    async def ChatCompletion(self, request, context):
        self.held.append(self.intake.budget.used)  # the call's lease while it is answered
        yield gateway_pb2.OpenAIResponse(body=str(len(request.body)).encode())


@contextlib.asynccontextmanager
async def _grpc(intake: Intake):
    servicer = _Echo(intake)
    server = GrpcServer("127.0.0.1", 0, public=True, interceptors=[GrpcIntake(intake)],
                        options={"grpc.max_receive_message_length": intake.max_body})
    server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer, "epd.gateway.v1.GatewayService")
    port = await server.start()
    intake.grpc_port = port  # for tests that open their own channel
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            yield gateway_pb2_grpc.GatewayServiceStub(ch), servicer
    finally:
        await server.stop(0)


def test_the_grpc_api_holds_what_its_message_needs_and_gives_it_back_when_the_call_ends():
    intake = Intake(_cfg())

    async def main():
        async with _grpc(intake) as (stub, servicer):
            answers = [r async for r in stub.ChatCompletion(gateway_pb2.OpenAIRequest(body=b"x" * 1000), timeout=10)]
            assert answers[0].body == b"1000"
            assert 0 < servicer.held[0] <= BODY_COPIES * 1100  # trimmed from the largest body to this message
            assert intake.budget.used == 0 and intake.reading == 0

    asyncio.run(main())


def test_grpc_calls_that_never_send_their_message_stall_at_most_the_grpc_readers_and_never_rest():
    # The stalled calls hold their slots until the body timeout: long enough that the call refused for want
    # of a slot (it waits WAIT_S, 1 s, for one) is made while they still hold them, however busy the host.
    intake = Intake(_cfg(body_timeout_s=6.0, max_body_readers=16, body_memory_mib=48))

    async def main():
        async with _grpc(intake) as (stub, servicer), _rest(intake) as port:
            # Calls whose message never comes: raw stream-stream calls that write nothing, each on its own
            # connection (one connection holds at most GRPC_READERS_PER_CONNECTION of the readers).
            method = "/epd.gateway.v1.GatewayService/ChatCompletion"
            async with contextlib.AsyncExitStack() as channels:
                raws = [await channels.enter_async_context(grpc.aio.insecure_channel(
                    f"127.0.0.1:{intake.grpc_port}", options=[("grpc.use_local_subchannel_pool", 1)]))
                    for _ in range(GRPC_READERS)]
                stalled = [raw.stream_stream(method)() for raw in raws]
                await wait_until(lambda: intake.grpc_reading == GRPC_READERS, 20, "every gRPC reader held")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await anext(aiter(stub.ChatCompletion(gateway_pb2.OpenAIRequest(body=b"{}"), timeout=10)))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                status, _ = await _raw(port, _head(2), [b"{}"])  # REST is not held up
                assert status == 200
                for call in stalled:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call.read()
                    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert intake.grpc_reading == 0 and intake.budget.used == 0

    asyncio.run(main())


def test_the_grpc_api_refuses_an_oversized_message_and_a_full_budget_without_reading():
    intake = Intake(_cfg())

    async def main():
        async with _grpc(intake) as (stub, servicer):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anext(aiter(stub.ChatCompletion(gateway_pb2.OpenAIRequest(body=bytes(intake.max_body + 10)),
                                                      timeout=10)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert intake.budget.used == 0
            # Fill the budget: no call can reserve its largest body, so none is read.
            assert await intake.budget.acquire(intake.budget.capacity, 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anext(aiter(stub.ChatCompletion(gateway_pb2.OpenAIRequest(body=b"{}"), timeout=10)))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "--body-memory-mib" in e.value.details()
            assert servicer.held == []
            intake.budget.release(intake.budget.capacity)

    asyncio.run(main())


def test_a_declared_length_is_not_charged_only_the_bytes_that_arrived():
    """Three clients declare the largest body and drip it: they hold what they sent, not eight times what
    they declared (which would fill this budget twice over), and a whole body still gets through."""
    intake = Intake(_cfg(body_timeout_s=20.0, body_min_rate_kib=0))
    assert 3 * BODY_COPIES * intake.max_body > intake.budget.capacity

    async def main():
        async with _rest(intake) as port:
            drips = [asyncio.ensure_future(_raw(port, _head(intake.max_body), [b"{"] * 400, delay=0.05))
                     for _ in range(3)]
            while intake.reading < 3:
                await asyncio.sleep(0.01)
            assert intake.budget.used < 1024  # a few bytes each
            body = b"x" * (1 << 20)
            status, rest = await _raw(port, _head(len(body)), [body])
            assert status == 200 and json.loads(rest) == {"bytes": len(body)}
            assert intake.reading == 3  # the drips are still being read
            for d in drips:
                d.cancel()
            await asyncio.gather(*drips, return_exceptions=True)
            while intake.reading:
                await asyncio.sleep(0.01)
            assert intake.budget.used == 0

    asyncio.run(asyncio.wait_for(main(), 60))  # a hang guard
