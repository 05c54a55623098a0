"""The services' one error boundary (services.common.errors.ErrorInterceptor), against a real
grpc.aio server: a handler's error ends its call with the mapped status, and nothing the handler
held survives the call through the exception grpc keeps (an AbortError chained to the handler's
error would keep its frames: a request's body, its decoded media)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from services.common.errors import BadInput
from services.common.grpc_server import GrpcServer

pytestmark = pytest.mark.integration


class _Payload:
    def __init__(self) -> None:
        self.data = bytearray(8 << 20)


class _Failing(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def _parse(self, payload: _Payload):
        raise BadInput("bad media") if payload else RuntimeError("boom /secret/path")

    async def Encode(self, request, context):
        payload = _Payload()  # what a handler holds: the request's decoded body
        self.refs.append(weakref.ref(payload))
        if request.request_id == "internal":
            raise RuntimeError(f"boom /secret/path {len(payload.data)}")
        self._parse(payload)
        yield encoder_pb2.EncodeEvent()

    async def GetInfo(self, request, context):
        payload = _Payload()
        self.refs.append(weakref.ref(payload))
        raise BadInput(f"no info for {len(payload.data)} bytes")


def test_a_handlers_error_ends_its_call_and_frees_what_the_handler_held():
    async def main():
        servicer = _Failing()
        server = GrpcServer("127.0.0.1", 0)
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.encoder.v1.EncoderService")
        port = await server.start()
        gc.disable()  # what is freed must be freed by reference counting, not by a later collection
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = encoder_pb2_grpc.EncoderServiceStub(ch)
                codes = []
                for call in (lambda: _drain(stub.Encode(encoder_pb2.EncodeRequest(request_id="bad"))),
                             lambda: _drain(stub.Encode(encoder_pb2.EncodeRequest(request_id="internal"))),
                             lambda: stub.GetInfo(encoder_pb2.GetInfoRequest())):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call()
                    codes.append((e.value.code(), e.value.details()))
            assert codes[0] == (grpc.StatusCode.INVALID_ARGUMENT, "bad media")
            assert codes[1][0] == grpc.StatusCode.INTERNAL and "request internal" in codes[1][1]
            assert "secret" not in codes[1][1] and "boom" not in codes[1][1]
            assert codes[2] == (grpc.StatusCode.INVALID_ARGUMENT, f"no info for {8 << 20} bytes")
            # The server's side of a call ends a loop step or two after the caller has its status (more on
            # a busy host): wait for it, with GC still off.
            deadline = asyncio.get_running_loop().time() + 30
            while any(r() is not None for r in servicer.refs) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert [r() for r in servicer.refs] == [None, None, None]
        finally:
            gc.enable()
            await server.stop(0)

    asyncio.run(main())


async def _drain(call) -> None:
    async for _ in call:
        pass
