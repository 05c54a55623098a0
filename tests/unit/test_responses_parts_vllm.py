"""The Responses API's media, found by the gateway exactly where vLLM 0.32 reads them: ``input`` items'
content parts, and a tool output item's ``output`` list (``function_call_output``,
``custom_tool_call_output``), which vLLM makes a tool message's content; an assistant item vLLM reads as
text has none. Each case's items, and those of generated bodies (hypothesis), are compared with what
vLLM's own request model, conversion (``construct_input_messages``) and chat parser read from the body;
a body vLLM refuses is refused by the gateway (or on purpose: ``DELIBERATE``) or stays refused as the
gateway sends it on."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.request import parse_openai
from tests.unit.test_parts_vllm import (  # that module skips without vLLM
    DELIBERATE,
    GRPC_MEDIA,
    _lm_body,
    _Recorder,
    chat_utils,
)

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
    "an assistant item vLLM reads as text drops its image": [
        {"role": "assistant", "content": [{"type": "input_text", "text": "I saw"}, _image(IMG)]},
        {"role": "user", "content": [_image(IMG2)]},
    ],
    "an assistant item whose first part is an image keeps it": [
        {"role": "assistant", "content": [_image(IMG), {"type": "input_text", "text": "that"}]},
    ],
    "custom tool output image": [
        {"type": "custom_tool_call", "call_id": "c1", "name": "look", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": [_image(IMG)]},
    ],
    "text tool output": [
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "no picture"},
    ],
}


def vllm_read(body: dict) -> list[tuple[str, object, object]]:
    """The media items (kind, source, uuid) vLLM 0.32 reads from a Responses body, in order, as its
    renderer gets them (``OnlineRenderer.render_responses``: the request model, ``construct_input_messages``,
    the chat parser); raises what vLLM raises."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    request = ResponsesRequest.model_validate(copy.deepcopy(body))
    recorder = _Recorder()
    for message in construct_input_messages(request_instructions=request.instructions, request_input=request.input):
        chat_utils._parse_chat_message_content(message, recorder, "openai", interleave_strings=False)
    return recorder.items


def vllm_items(body: dict) -> list[tuple[str, object]]:
    return [(kind, src) for kind, src, _ in vllm_read(body)]


@pytest.mark.parametrize("case", list(CASES))
def test_the_gateway_finds_the_responses_media_vllm_reads(case):
    body = {"input": CASES[case]}
    call = parse_openai("responses", json.dumps(body).encode(), CFG)
    assert list(zip(call.modalities, call.sources)) == vllm_items(body)


def test_a_tool_output_image_is_rewritten_in_place_like_any_other():
    from services.gateway.values import Media

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
    sent = json.loads(call.for_lm().render(req, media))
    assert sent["input"][2]["output"][1]["uuid"] == "sha-1" and sent["input"][0]["content"][0]["uuid"] == "sha-0"
    assert sent["input"][2]["output"][0] == {"type": "input_text", "text": "here"}
    assert [kind for kind, _ in vllm_items(sent)] == ["image", "image"]  # vLLM takes the rewritten body


URL = st.sampled_from([IMG, "http://127.0.0.1:9/x.png", "file:///etc/passwd", "epd-media:0", "epd-media:7", ""])
INPUT_IMAGE = st.fixed_dictionaries(
    {"type": st.just("input_image")},
    optional={"image_url": st.one_of(URL, st.none(), st.fixed_dictionaries({"url": URL}), st.integers(0, 1)),
              "detail": st.sampled_from(["auto", "low", "high", "original", "ultra"]), "file_id": st.just("f1"),
              "uuid": st.just("u")})
OTHER_PART = st.sampled_from([
    {"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b", "annotations": []},
    {"type": "input_file", "file_id": "f"}, {"type": "refusal", "refusal": "no"}, "plain",
    {"type": "image_url", "image_url": {"url": IMG}}, {"image_url": IMG}, {"type": "input_image", "uuid": "u"},
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}},
    {"type": "image_embeds", "image_embeds": "AAAA"}])
PARTS = st.lists(st.one_of(INPUT_IMAGE, OTHER_PART), max_size=3)
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                           "content": st.one_of(st.just("hi"), PARTS)},
                          optional={"type": st.just("message"), "id": st.just("m1"), "status": st.just("completed")}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "custom_tool_call"]), "call_id": st.just("c1"),
                           "name": st.just("f")}, optional={"arguments": st.just("{}"), "input": st.just("x")}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
                           "call_id": st.just("c1"), "output": st.one_of(st.just("done"), PARTS)},
                          optional={"id": st.just("o1"), "status": st.just("completed")}),
    st.just({"type": "reasoning", "id": "r1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]}),
    st.just({"type": "item_reference", "id": "x1"}),
)
BODY = st.fixed_dictionaries({"model": st.just("m"),
                              "input": st.one_of(st.just("hi"), st.lists(ITEM, min_size=1, max_size=4))},
                             optional={"instructions": st.just("be brief")})
ANY_CFG = GatewayConfig(lms="lm:1", max_images=100, max_audios=100, max_videos=100)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(BODY)
def test_the_gateway_finds_exactly_the_responses_media_vllm_reads_and_sends_on_none_it_did_not_issue(body):
    try:
        call, refused = parse_openai("responses", json.dumps(body).encode(), ANY_CFG, GRPC_MEDIA), None
    except ApiError as e:
        call, refused = None, e.message
    try:
        read = vllm_read(body)
    except Exception:  # noqa: BLE001 - vLLM refuses the body (400): nothing of it reaches an engine
        read = None
    if call is None:
        if read is not None:  # vLLM would take it; the gateway refuses it on purpose only
            assert any(reason in refused for reason in DELIBERATE), refused
        return
    if read is not None:  # the same items, in the same order, from the same sources
        assert [kind for kind, _, _ in read] == call.modalities
        assert [GRPC_MEDIA[0] if src == "epd-media:0" else src for _, src, _ in read] == call.sources
    lm_body, issued = _lm_body(call, len(call.sources))
    try:
        sent = vllm_read(lm_body)
    except Exception:  # noqa: BLE001 - vLLM refuses the body as sent on too: nothing reaches an engine
        return
    assert read is not None, "vLLM refuses the client's body but takes the one the gateway sends on"
    assert [(kind, uuid) for kind, _, uuid in sent] == list(zip(call.modalities, issued))


def test_an_image_in_a_custom_tool_output_item_with_an_id_and_a_status_is_400_as_vllms_parser_answers():
    """vLLM reads such an item as its output-item model and its ``model_dump`` gives the image part
    ``prompt_cache_breakpoint: null``, which its chat parser refuses; the gateway's uuid-named rewrite would
    be taken, so the gateway refuses it itself."""
    item = {"type": "custom_tool_call_output", "call_id": "c1", "output": [_image(IMG)], "id": "o1",
            "status": "completed"}
    body = {"model": "m", "input": [item]}
    with pytest.raises(ValueError):  # pydantic's ValidationError: vLLM's 400
        vllm_read(body)
    with pytest.raises(ApiError, match="custom_tool_call_output item with an id and a status") as e:
        parse_openai("responses", json.dumps(body).encode(), CFG)
    assert e.value.status == 400
    del item["status"]
    assert list(zip(parse_openai("responses", json.dumps(body).encode(), CFG).modalities, [IMG])) == vllm_items(body)
