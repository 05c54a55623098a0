"""Every internal port of a running deployment (mutual TLS and the token, as the
session's deployment runs) refuses a caller that cannot prove who it is: one
without a client certificate, and one with a certificate but no token."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc

pytestmark = pytest.mark.e2e


def _calls(dep) -> dict[str, tuple[str, callable]]:
    """Per internal port: its address and one call that would read, reserve or run something."""
    with dep.client_security.channel(dep.encoder_addr) as ch:
        transfer = encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(encoder_pb2.GetInfoRequest(),
                                                                   timeout=10).transfer_endpoint

    def reserve(ch):
        hello = transfer_pb2.TransferClientMsg(hello=transfer_pb2.Hello(consumer_id="stranger"))
        reserve = transfer_pb2.TransferClientMsg(reserve=transfer_pb2.Reserve(identifier="x", max_nbytes=8))
        return list(transfer_pb2_grpc.TransferServiceStub(ch).Transfer(iter([hello, reserve]), timeout=10))

    return {
        "encoder Encode": (dep.encoder_addr, lambda ch: list(encoder_pb2_grpc.EncoderServiceStub(ch).Encode(
            encoder_pb2.EncodeRequest(items=[encoder_pb2.MediaItem(data=b"x")]), timeout=10))),
        "encoder Holdings": (dep.encoder_addr, lambda ch: encoder_pb2_grpc.EncoderServiceStub(ch).Holdings(
            transfer_pb2.HoldingsRequest(), timeout=10)),
        "encoder GetInfo": (dep.encoder_addr, lambda ch: encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(
            encoder_pb2.GetInfoRequest(), timeout=10)),
        "lm Generate": (dep.lm_addr, lambda ch: list(lm_pb2_grpc.LMServiceStub(ch).Generate(
            lm_pb2.GenerateRequest(openai=lm_pb2.OpenAIRequest(api="completions", body=b'{"prompt": "hi"}')), timeout=10))),
        "lm Holdings": (dep.lm_addr, lambda ch: lm_pb2_grpc.LMServiceStub(ch).Holdings(transfer_pb2.HoldingsRequest(),
                                                                                       timeout=10)),
        "transfer Stats": (transfer, lambda ch: transfer_pb2_grpc.TransferServiceStub(ch).Stats(
            transfer_pb2.StatsRequest(), timeout=10)),
        "transfer Holdings": (transfer, lambda ch: transfer_pb2_grpc.TransferServiceStub(ch).Holdings(
            transfer_pb2.HoldingsRequest(), timeout=10)),
        "transfer Reserve": (transfer, reserve),
    }


def test_every_internal_port_refuses_callers_without_a_certificate_or_a_token(deployment):
    assert deployment.client_security.tls_cert and deployment.client_security.token
    no_cert = dataclasses.replace(deployment.client_security, tls_cert="", tls_key="")
    no_token = dataclasses.replace(deployment.client_security, auth_token_file="")
    for name, (addr, call) in _calls(deployment).items():
        for who, channel, code in (("plain", grpc.insecure_channel(addr), grpc.StatusCode.UNAVAILABLE),
                                   ("no client certificate", no_cert.channel(addr), grpc.StatusCode.UNAVAILABLE),
                                   ("no token", no_token.channel(addr), grpc.StatusCode.UNAUTHENTICATED)):
            with channel as ch, pytest.raises(grpc.RpcError) as e:
                call(ch)
            assert e.value.code() == code, f"{name}, {who}: {e.value.code()} {e.value.details()}"


def test_an_authenticated_caller_gets_through(deployment):
    calls = _calls(deployment)
    with deployment.client_security.channel(calls["transfer Stats"][0]) as ch:
        calls["transfer Stats"][1](ch)
    with deployment.client_security.channel(deployment.lm_addr) as ch:
        assert lm_pb2_grpc.LMServiceStub(ch).GetInfo(lm_pb2.GetInfoRequest(), timeout=10).model
