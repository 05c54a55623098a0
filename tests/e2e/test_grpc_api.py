"""The native gRPC API mirrors chat completions; every service has health; reflection is off unless asked for."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2
from services.common.images import make_image
from tests.e2e.conftest import REFERENCE_REQUESTS

pytestmark = pytest.mark.e2e


def test_native_grpc_chat_streams_the_same_tokens_as_rest(deployment, reference):
    body = REFERENCE_REQUESTS["image0"]
    req = gateway_pb2.ChatCompletionRequest(sampling=lm_pb2.SamplingOptions(max_tokens=body["max_tokens"],
                                                                            temperature=0))
    msg = req.messages.add(role="user")
    msg.content.add(image=gateway_pb2.ImagePart(data=make_image(0)))
    msg.content.add(text=body["messages"][0]["content"][1]["text"])
    with grpc.insecure_channel(deployment.gateway_grpc) as ch:
        chunks = list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(req, timeout=60))
    assert [t for c in chunks for t in c.token_ids] == reference["image0"]
    assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens == len(reference["image0"])


def test_native_grpc_bad_image_is_invalid_argument(deployment):
    req = gateway_pb2.ChatCompletionRequest()
    req.messages.add(role="user").content.add(image=gateway_pb2.ImagePart(data=b"not an image"))
    with grpc.insecure_channel(deployment.gateway_grpc) as ch, pytest.raises(grpc.RpcError) as e:
        list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image" in e.value.details()


@pytest.mark.parametrize("which,service", [("encoder_addr", "epd.encoder.v1.EncoderService"),
                                           ("lm_addr", "epd.lm.v1.LMService"),
                                           ("gateway_grpc", "epd.gateway.v1.GatewayService")])
def test_health_on_every_service_and_no_reflection_unless_asked(deployment, which, service):
    # The gateway's gRPC API is public (plain); encoders and LMs speak mutual TLS here.
    secure = which != "gateway_grpc"
    with (deployment.client_security.channel if secure else grpc.insecure_channel)(getattr(deployment, which)) as ch:
        for name in ("", service):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
