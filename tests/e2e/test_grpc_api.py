"""The native gRPC API is the OpenAI API over gRPC; every service has health; reflection is off unless asked for."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import REFERENCE_REQUESTS
from tools.media import make_image

pytestmark = pytest.mark.e2e


def _grpc(deployment, method: str, body: dict, media: list[bytes] = ()) -> list[gateway_pb2.OpenAIResponse]:
    req = gateway_pb2.OpenAIRequest(body=json.dumps(body).encode(), media=list(media))
    with grpc.insecure_channel(deployment.gateway_grpc) as ch:
        return list(getattr(gateway_pb2_grpc.GatewayServiceStub(ch), method)(req, timeout=60))


def test_native_grpc_chat_streams_the_same_tokens_as_rest(deployment, reference):
    """The OpenAI body over gRPC, its image as raw bytes (epd-media:0): the chunks REST streams."""
    body = json.loads(json.dumps(REFERENCE_REQUESTS["image0"]))
    body["messages"][0]["content"][0]["image_url"]["url"] = "epd-media:0"
    out = _grpc(deployment, "ChatCompletion", dict(body, stream=True, stream_options={"include_usage": True}),
                [make_image(0)])
    chunks = [json.loads(m.body) for m in out if m.body]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert tokens == reference["image0"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(reference["image0"])
    epd = json.loads(out[-1].epd)
    assert epd["encoders"] == [deployment.encoder_addr] and epd["local_encoder_runs"] == 0


def test_native_grpc_completion_and_full_response(deployment, reference):
    out = _grpc(deployment, "ChatCompletion", REFERENCE_REQUESTS["text"])
    assert json.loads(out[0].body)["choices"][0]["token_ids"] == reference["text"] and out[-1].epd
    out = _grpc(deployment, "Completion", {"prompt": "Once upon a time", "max_tokens": 4})
    assert json.loads(out[0].body)["object"] == "text_completion"


def test_native_grpc_bad_image_is_invalid_argument(deployment):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "epd-media:0"}}]}]}
    with pytest.raises(grpc.RpcError) as e:
        _grpc(deployment, "ChatCompletion", body, [b"not an image"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image" in e.value.details()


def test_native_grpc_bad_value_is_vllms_error(deployment):
    with pytest.raises(grpc.RpcError) as e:
        _grpc(deployment, "ChatCompletion", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()


def _rest(deployment, path: str, body: dict | None) -> dict:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(deployment.url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    out.pop("epd", None)
    return out


def test_native_grpc_serves_the_rest_of_the_surface_as_rest_does(deployment):
    """Responses (an input_image as epd-media:0), Messages (a url source epd-media:0), tokenize and
    version over gRPC: the answers REST gives for the same bodies with the image inline."""
    from tools.media import data_url

    img = make_image(77)
    text = {"type": "input_text", "text": "What is it?"}
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "epd-media:0"}, text]}],
            "max_output_tokens": 6, "temperature": 0}
    got = json.loads(_grpc(deployment, "Responses", body, [img])[0].body)
    body["input"][0]["content"][0]["image_url"] = data_url(img)
    want = _rest(deployment, "/v1/responses", body)
    assert got["output"][0]["content"][0]["text"] == want["output"][0]["content"][0]["text"]
    assert got["usage"] == want["usage"]

    body = {"model": deployment.model, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "epd-media:0"}}, {"type": "text", "text": "Hi"}]}]}
    events = [json.loads(m.body) for m in _grpc(deployment, "Messages", dict(body, stream=True), [img]) if m.body]
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    body["messages"][0]["content"][0]["source"] = {"type": "base64", "media_type": "image/png",
                                                   "data": data_url(img).split(",", 1)[1]}
    assert streamed == _rest(deployment, "/v1/messages", body)["content"][0]["text"]

    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "epd-media:0"}}]}]}
    got = json.loads(_grpc(deployment, "Tokenize", body, [img])[0].body)
    body["messages"][0]["content"][0]["image_url"]["url"] = data_url(img)
    assert got == _rest(deployment, "/tokenize", body)
    assert json.loads(_grpc(deployment, "Version", {})[0].body) == _rest(deployment, "/version", None)


def _rest_status(deployment, method: str, path: str, body: dict | None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(deployment.url + path, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_native_grpc_stored_responses_count_tokens_and_detokenize_as_rest(deployment):
    """The session's LM stores responses (VLLM_ENABLE_RESPONSES_API_STORE=1): GetResponse gives what
    GET /v1/responses/{id} gives, CancelResponse ends as the REST cancel does (same status, as its
    gRPC code), an unknown or malformed id is refused; CountTokens and Detokenize answer as REST."""
    from services.gateway.errors import grpc_code

    with grpc.insecure_channel(deployment.gateway_grpc) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        created = json.loads(list(stub.Responses(gateway_pb2.OpenAIRequest(body=json.dumps(
            {"input": "Hello", "max_output_tokens": 4, "temperature": 0}).encode()), timeout=60))[0].body)
        ref = gateway_pb2.ResponseRef(response_id=created["id"])
        got = json.loads(list(stub.GetResponse(ref, timeout=60))[0].body)
        status, want = _rest_status(deployment, "GET", f"/v1/responses/{created['id']}", None)
        want.pop("epd", None)
        assert status == 200 and got == want
        status, want = _rest_status(deployment, "POST", f"/v1/responses/{created['id']}/cancel", {})
        if status == 200:
            assert json.loads(list(stub.CancelResponse(ref, timeout=60))[0].body)["id"] == created["id"]
        else:  # vLLM refuses to cancel a finished synchronous response
            with pytest.raises(grpc.RpcError) as e:
                list(stub.CancelResponse(ref, timeout=60))
            assert e.value.code() == grpc_code(status), (status, want)
        for bad in ("resp_nope", "../etc"):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.GetResponse(gateway_pb2.ResponseRef(response_id=bad), timeout=60))
            assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), e.value

    body = {"model": deployment.model, "messages": [{"role": "user", "content": "Count me"}]}
    got = json.loads(_grpc(deployment, "CountTokens", body)[0].body)
    assert got == _rest(deployment, "/v1/messages/count_tokens", body)
    body = {"tokens": [10, 11, 12]}
    assert json.loads(_grpc(deployment, "Detokenize", body)[0].body) == _rest(deployment, "/detokenize", body)


@pytest.mark.parametrize("which,service", [("encoder_addr", "epd.encoder.v1.EncoderService"),
                                           ("lm_addr", "epd.lm.v1.LMService"),
                                           ("gateway_grpc", "epd.gateway.v1.GatewayService")])
def test_health_on_every_service_and_no_reflection_unless_asked(deployment, which, service):
    # The gateway's gRPC API is public (plain); encoders and LMs speak mutual TLS here.
    secure = which != "gateway_grpc"
    with (deployment.client_security.channel if secure else grpc.insecure_channel)(getattr(deployment, which)) as ch:
        for name in ("", service):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=30))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
