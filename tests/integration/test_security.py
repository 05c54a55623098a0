"""Authentication on every gRPC port: the services' API servers (GrpcServer)
and the Transfer server, with a shared token and with mutual TLS, against
real grpc.aio servers on loopback. No vLLM."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ectransfer.protocol import TransferState
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from peerauth import SecurityConfig
from services.certs import make_certs, make_token
from services.common.grpc_server import GrpcServer
from services.common.protocol import ENCODER_PROTOCOL
from tests.support.loopback import Consumer, Producer

pytestmark = pytest.mark.integration


class CountingEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Counts the calls its handlers actually ran."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetInfo(self, request, context):
        self.calls += 1
        return encoder_pb2.EncoderInfo(encoder_id="e", protocol=ENCODER_PROTOCOL)

    async def Encode(self, request, context):
        self.calls += 1
        yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(identifier="x"))


async def _serve(security: SecurityConfig) -> tuple[GrpcServer, CountingEncoder, str]:
    servicer = CountingEncoder()
    server = GrpcServer("127.0.0.1", 0, security)
    server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.encoder.v1.EncoderService")
    port = await server.start()
    await server.set_serving(True)
    return server, servicer, f"127.0.0.1:{port}"


async def _calls(channel) -> list[grpc.StatusCode]:
    """The status of a unary and a server-streaming call (OK when it worked)."""
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    out = []
    for call in (lambda: stub.GetInfo(encoder_pb2.GetInfoRequest(), timeout=30),
                 lambda: _drain(stub.Encode(encoder_pb2.EncodeRequest(), timeout=30))):
        try:
            await call()
            out.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as e:
            out.append(e.code())
    return out


async def _drain(call) -> None:
    async for _ in call:
        pass


@pytest.fixture
def token(tmp_path):
    return make_token(str(tmp_path / "token"))


@pytest.fixture
def pki(tmp_path):
    return make_certs(str(tmp_path / "tls"), ["localhost", "127.0.0.1"])


def test_a_caller_without_the_token_or_with_a_wrong_one_is_refused_before_any_handler_runs(token, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")

    async def main():
        server, servicer, addr = await _serve(SecurityConfig(auth_token_file=token))
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.UNAUTHENTICATED] * 2
                # Health says only SERVING or not, and probes carry no token.
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            async with SecurityConfig(auth_token_file=str(wrong)).aio_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.UNAUTHENTICATED] * 2
            assert servicer.calls == 0
            async with SecurityConfig(auth_token_file=token).aio_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.OK] * 2
            assert servicer.calls == 2
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_mutual_tls_refuses_plain_and_certificateless_clients(pki):
    async def main():
        server, servicer, addr = await _serve(SecurityConfig(**pki))
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.UNAVAILABLE] * 2
            async with SecurityConfig(tls_ca=pki["tls_ca"]).aio_channel(addr) as ch:  # verifies, presents nothing
                assert await _calls(ch) == [grpc.StatusCode.UNAVAILABLE] * 2
            assert servicer.calls == 0
            async with SecurityConfig(**pki).aio_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.OK] * 2
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_client_refuses_a_server_whose_certificate_its_ca_did_not_sign(pki, tmp_path):
    other = make_certs(str(tmp_path / "other"), ["localhost", "127.0.0.1"])

    async def main():
        server, servicer, addr = await _serve(SecurityConfig(**other))
        try:
            async with SecurityConfig(**pki).aio_channel(addr) as ch:
                assert await _calls(ch) == [grpc.StatusCode.UNAVAILABLE] * 2
            assert servicer.calls == 0
        finally:
            await server.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["token", "tls"])
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_the_transfer_port_serves_only_authenticated_consumers(mode, transport, token, pki):
    server_sec = SecurityConfig(auth_token_file=token) if mode == "token" else SecurityConfig(**pki)
    producer = Producer(security=server_sec)
    t = torch.arange(64 * 128, dtype=torch.float32).reshape(64, 128).to(torch.bfloat16)
    try:
        producer.store.put("item", t)
        stranger = Consumer(transports=(transport,), timeout_s=30)
        try:
            transfer, got = stranger.get(producer.endpoint, "item", t.numel() * 2)
            assert transfer.state is TransferState.FAILED and got is None
            assert ("UNAUTHENTICATED" if mode == "token" else "UNAVAILABLE") in transfer.error
        finally:
            stranger.close()
        assert producer.store.stats.acks == 0
        friend = Consumer(transports=(transport,), security=server_sec)
        try:
            transfer, got = friend.get(producer.endpoint, "item", t.numel() * 2)
            assert transfer.state is TransferState.LANDED, transfer.error
            assert torch.equal(got, t)
        finally:
            friend.close()
    finally:
        producer.close()


def test_stats_on_the_transfer_port_needs_the_token(token):
    producer = Producer(security=SecurityConfig(auth_token_file=token))
    try:
        with grpc.insecure_channel(producer.endpoint) as ch, pytest.raises(grpc.RpcError) as e:
            transfer_pb2_grpc.TransferServiceStub(ch).Stats(transfer_pb2.StatsRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SecurityConfig(auth_token_file=token).channel(producer.endpoint) as ch:  # raises if refused
            transfer_pb2_grpc.TransferServiceStub(ch).Stats(transfer_pb2.StatsRequest(), timeout=30)
    finally:
        producer.close()


def test_a_refused_caller_s_large_request_message_is_never_read(token, monkeypatch):
    """The token is checked on the call's headers; a refused Encode (one request message, here
    32 MiB of media) gets a handler that never reads it: the request is never deserialized, and
    the caller still gets UNAUTHENTICATED."""
    parsed = []
    real = encoder_pb2.EncodeRequest.FromString
    monkeypatch.setattr(encoder_pb2.EncodeRequest, "FromString",
                        staticmethod(lambda b: (parsed.append(len(b)), real(b))[1]))

    async def main():
        server, servicer, addr = await _serve(SecurityConfig(auth_token_file=token))
        try:
            req = encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=bytes(32 << 20))])
            async with grpc.aio.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _drain(encoder_pb2_grpc.EncoderServiceStub(ch).Encode(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert servicer.calls == 0 and parsed == []
        finally:
            await server.stop(0)

    asyncio.run(main())
