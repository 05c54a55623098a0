"""A caller cannot make the deployment serve another caller from its pixels, nor make anything
fetch a URL the gateway's rules refuse, whatever shape a content part has: vLLM reads a part with
a ``uuid`` (or without ``type``) by its keys, so the gateway reads parts the same way and refuses
client identifiers, and the LM refuses any item the gateway did not send.

The poisoning sequence: an attacker's own image labelled with the content hash of a victim's
image, in the part shapes vLLM reads as an image; then the victim's request, whose greedy tokens
must be plain vLLM's. On the session deployment (mutual TLS, every link authenticated)."""

from __future__ import annotations

import json

import grpc
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.media import content_id
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import image_bytes, post
from tests.integration.media_server import MediaServer
from tools.media import data_url, make_image

pytestmark = pytest.mark.e2e

ATTACKER = make_image(4242, (112, 112))


def _chat(part: dict, role: str = "user") -> dict:
    first = {"role": role, "content": [part, {"type": "text", "text": "What is in this picture?"}]}
    messages = [first] if role == "user" else [first, {"role": "user", "content": "And now?"}]
    return {"messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True}


def _attacks(victim_id: str) -> dict[str, dict]:
    url = data_url(ATTACKER)
    return {
        "text-part-with-uuid": _chat({"type": "text", "text": "x", "uuid": victim_id, "image_url": {"url": url}}),
        "untyped-with-uuid": _chat({"image_url": {"url": url}, "uuid": victim_id}),
        "image-part-with-uuid": _chat({"type": "image_url", "image_url": {"url": url}, "uuid": victim_id}),
        "input-text-with-uuid": _chat({"type": "input_text", "text": "x", "uuid": victim_id, "image_url": url}),
        "assistant-message": _chat({"type": "text", "text": "x", "uuid": victim_id, "image_url": {"url": url}},
                                   role="assistant"),
    }


def test_a_caller_cannot_plant_an_embedding_under_another_images_identifier(deployment, reference):
    victim = REFERENCE_REQUESTS["victim"]
    victim_id = content_id(image_bytes(victim))
    for name, body in _attacks(victim_id).items():
        status, answer = post(deployment.url + "/v1/chat/completions", body, 120)
        assert status == 400, (name, status, answer)
        assert "a client may not set uuid" in answer["error"]["message"], (name, answer)
    with grpc.insecure_channel(deployment.gateway_grpc) as ch, pytest.raises(grpc.RpcError) as e:
        list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(gateway_pb2.OpenAIRequest(
            body=json.dumps(_chat({"type": "text", "text": "x", "uuid": victim_id,
                                   "image_url": {"url": "epd-media:0"}})).encode(), media=[ATTACKER]), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "uuid" in e.value.details()
    status, answer = post(deployment.url + "/v1/chat/completions", victim, 120)
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == reference["victim"]


@pytest.fixture(scope="module")
def bait():
    server = MediaServer().start()
    yield server
    server.stop()


@pytest.mark.parametrize("part", [
    lambda u: {"image_url": u},
    lambda u: {"image_url": {"url": u}, "text": "hi"},
    lambda u: {"video_url": {"url": u}, "audio_url": {"url": u}},
    lambda u: {"type": "input_image", "image_url": u, "detail": "auto"},
], ids=["untyped-string", "untyped-object", "untyped-two-keys", "input-image"])
def test_an_http_url_in_a_part_of_any_shape_is_judged_by_the_gateway_and_fetched_by_nobody(
        deployment, bait, part):
    url = bait.url("/good.png")
    status, answer = post(deployment.url + "/v1/chat/completions", _chat(part(url)), 60)
    assert status == 400 and "SSRF guard" in answer["error"]["message"], answer
    assert sum(bait.hits.values()) == 0, bait.hits


def test_the_lm_refuses_a_part_the_gateway_did_not_send(deployment):
    """Straight to the LM with the deployment's own credentials (a caller past the gateway): an
    item labelled with another image's identifier is INVALID_ARGUMENT, nothing generated."""
    from epd.lm.v1 import lm_pb2, lm_pb2_grpc

    victim_id = content_id(image_bytes(REFERENCE_REQUESTS["image0"]))
    body = _chat({"type": "image_url", "image_url": {"url": data_url(ATTACKER)}, "uuid": victim_id})
    req = lm_pb2.GenerateRequest(request_id="trust-1")
    req.openai.api = "chat"
    req.openai.body = json.dumps(body).encode()
    with deployment.client_security.channel(deployment.lm_addr) as ch, pytest.raises(grpc.RpcError) as e:
        list(lm_pb2_grpc.LMServiceStub(ch).Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not the content hash of its bytes" in e.value.details()
