"""Issue 22: the gateway's reading of the other APIs' bodies (Responses input items, Anthropic
Messages image blocks, tokenize) and the LM body each attempt gets. vLLM's own readers are checked
against these in tests/integration/test_surface_parts_vllm.py; the answers against `vllm serve` in
tests/e2e/test_openai_parity.py."""

import asyncio
import base64
import hashlib
import json

import pytest
from helpers import data_url, image_bytes

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.openai_api import API, APIS, ApiError, error_body, load_media, parse_openai
from services.gateway.parts import anthropic_media_parts

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="x:1")
PNG = image_bytes("PNG")
B64 = base64.b64encode(PNG).decode()
IDENT = hashlib.sha256(PNG).hexdigest()


def _load(api: str, body: dict):
    call = parse_openai(api, json.dumps(body).encode(), CFG)
    req = lm_pb2.GenerateRequest(request_id="r-1")
    media = asyncio.run(load_media(call, req, CFG, None))
    return call, req, media


def _laid_out(req):
    for item in req.items:
        item.source.CopyFrom(lm_pb2.ItemSource(transfer_endpoint="e:1", num_embeds=1, embed_width=4,
                                               placeholder_token_ids=[5],
                                               prompt_token_ids=[5]))


def test_every_api_has_a_route_and_only_chat_and_completions_are_named_to_the_lm():
    assert {a.lm_api for a in APIS} == {"chat", "completions", "http"}
    assert [a.name for a in APIS if a.lm_api != "http"] == ["chat", "completions"]
    assert len({(a.method, a.path) for a in APIS}) == len(APIS)


def test_responses_input_images_become_uuid_only_input_image_parts():
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)},
                                                   {"type": "input_text", "text": "hi"}]}], "stream": True}
    call, req, media = _load("responses", body)
    assert [(p.container, p.message, p.part) for p in call.parts] == [("input", 0, 0)] and call.stream
    assert [i.identifier for i in req.items] == [IDENT]
    _laid_out(req)
    sent = json.loads(call.lm_body(req, media))
    assert sent["input"][0]["content"][0] == {"type": "input_image", "image_url": None, "uuid": IDENT}
    assert "request_id" not in sent  # vLLM's app names Responses by its own ids


def test_a_string_responses_input_has_no_media():
    call, req, _ = _load("responses", {"input": "hello"})
    assert call.parts == [] and len(req.items) == 0


def test_a_client_uuid_in_responses_input_is_refused():
    with pytest.raises(ApiError, match="uuid") as e:
        _load("responses", {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(PNG), "uuid": "x"}]}]})
    assert "input[0].content[0]" in e.value.message


def test_anthropic_images_keep_their_bytes_for_the_lm_to_recognise_by_hash():
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": B64}},
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "x"}, {"type": "image", "source": {"type": "base64", "data": B64}}]}]}]}
    call, req, media = _load("messages", body)
    assert [(p.message, p.part, p.inner) for p in call.parts] == [(0, 1, 1), (0, 0, -1)]  # as vLLM orders them
    assert [i.identifier for i in req.items] == [IDENT, IDENT]
    _laid_out(req)
    sent = json.loads(call.lm_body(req, media))
    blocks = sent["messages"][0]["content"]
    for source in (blocks[0]["source"], blocks[1]["content"][1]["source"]):
        assert source == {"type": "base64", "media_type": "image/png", "data": B64}


def test_anthropic_tool_result_images_count_only_in_user_messages():
    """vLLM's converter reads a tool result's images only in a user message."""
    block = {"type": "tool_result", "content": [{"type": "image", "source": {"type": "base64", "data": B64}}]}
    assert len(anthropic_media_parts([{"role": "user", "content": [block]}])) == 1
    assert anthropic_media_parts([{"role": "assistant", "content": [block]}]) == []


def test_token_counting_apis_send_the_bytes_and_no_items():
    """tokenize and count_tokens lay the prompt out on the LM (its processor): no encoder, no item."""
    call, req, media = _load("tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}]})
    assert len(req.items) == 0 and len(media) == 1
    sent = json.loads(call.lm_body(req, media))
    part = sent["messages"][0]["content"][0]
    assert "uuid" not in part and base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == PNG
    call, req, media = _load("count_tokens", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": B64}}]}]})
    assert len(req.items) == 0 and len(media) == 1


def test_a_get_route_has_an_empty_body():
    call = parse_openai("version", b"", CFG)
    assert call.body == {} and call.parts == []


def test_anthropic_errors_have_anthropics_shape():
    err = ApiError(400, "bad", "invalid_request_error")
    assert error_body(err, anthropic=True) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                          "message": "bad"}}
    assert API["messages"].anthropic and not API["responses"].anthropic
