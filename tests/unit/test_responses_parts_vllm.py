"""The Responses API's media, found by the gateway exactly where vLLM 0.32 reads them: ``input`` items'
content parts, and a tool output item's ``output`` list (``function_call_output``,
``custom_tool_call_output``), which vLLM makes a tool message's content. Each case's items are compared
with what vLLM's own conversion (``construct_input_messages``) and chat parser read from the body."""

from __future__ import annotations

import json

import pytest
from test_parts_vllm import _Recorder, chat_utils  # vLLM's parser; that module skips without vLLM

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.request import parse_openai

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="lm:1")
IMG = "data:image/png;base64,iVBORw0KGgo="
IMG2 = "data:image/png;base64,iVBORw0KGgoB"


def _image(url: str) -> dict:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


CASES = {
    "tool output image": [
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [_image(IMG)]},
    ],
    "tool output image beside an input image": [
        {"role": "user", "content": [_image(IMG2), {"type": "input_text", "text": "and?"}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"}, _image(IMG)]},
    ],
    "text tool output": [
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "no picture"},
    ],
}


def vllm_items(body: dict) -> list[tuple[str, object]]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    request = ResponsesRequest.model_validate(body)
    recorder = _Recorder()
    for message in construct_input_messages(request_instructions=None, request_input=request.input):
        chat_utils._parse_chat_message_content(message, recorder, "openai", interleave_strings=False)
    return [(kind, src) for kind, src, _ in recorder.items]


@pytest.mark.parametrize("case", list(CASES))
def test_the_gateway_finds_the_responses_media_vllm_reads(case):
    body = {"input": CASES[case]}
    call = parse_openai("responses", json.dumps(body).encode(), CFG)
    assert list(zip(call.modalities, call.sources)) == vllm_items(body)


def test_a_tool_output_image_is_rewritten_in_place_like_any_other():
    from services.gateway.orchestrator import Media

    body = {"input": CASES["tool output image beside an input image"]}
    call = parse_openai("responses", json.dumps(body).encode(), CFG)
    assert [p.where for p in call.parts] == ["input[0].content[0]", "input[2].output[1]"]
    req = lm_pb2.GenerateRequest()
    media = []
    for n, p in enumerate(call.parts):
        item = req.items.add(identifier=f"sha-{n}")
        item.source.transfer_endpoint = "enc:1"
        item.source.placeholder_token_ids.append(1)
        media.append(Media(b"png", f"sha-{n}", p.modality))
    sent = json.loads(call.lm_body(req, media))
    assert sent["input"][2]["output"][1]["uuid"] == "sha-1" and sent["input"][0]["content"][0]["uuid"] == "sha-0"
    assert sent["input"][2]["output"][0] == {"type": "input_text", "text": "here"}
    assert [kind for kind, _ in vllm_items(sent)] == ["image", "image"]  # vLLM takes the rewritten body
