"""The gateway reads an Anthropic Messages body's images (``services.gateway.parts.anthropic_media_parts``)
as vLLM 0.32's converter does (``AnthropicServingMessages.to_chat_completion_request``, which the LM's
vLLM runs): generated bodies (hypothesis), validated by vLLM's own request model as `vllm serve`
validates them, converted by vLLM, and the images vLLM's chat request then carries must be exactly
the ones the gateway found, in order, with the same URLs; a body vLLM refuses is refused by the gateway
or stays refused as the gateway sends it on, and vLLM reads exactly the gateway's images from that."""

from __future__ import annotations

import asyncio
import base64
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.fetch import load_images
from services.gateway.parts import PartError, anthropic_media_parts
from services.gateway.request import parse_openai
from services.gateway.values import Media
from tests.unit.helpers import image_bytes

pytestmark = pytest.mark.unit

serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")
protocol = pytest.importorskip("vllm.entrypoints.anthropic.protocol")

_source = st.one_of(
    st.fixed_dictionaries({"type": st.just("base64"), "data": st.sampled_from(["AAAA", "iVBORw0K", ""])},
                          optional={"media_type": st.sampled_from(["image/png", "image/jpeg", "text/plain"])}),
    st.fixed_dictionaries({"type": st.just("url"), "url": st.sampled_from(["http://x/a.png", ""])}),
    st.fixed_dictionaries({}, optional={"data": st.just("AAAA"), "media_type": st.just("image/png")}),
    st.just({}),
)
_image = st.fixed_dictionaries({"type": st.just("image"), "source": _source},
                               optional={"uuid": st.just("attacker"), "cache_control": st.just({"type": "x"})})
_text = st.fixed_dictionaries({"type": st.just("text"), "text": st.sampled_from(["hi", "look"])})
_tool_result = st.fixed_dictionaries({
    "type": st.just("tool_result"), "tool_use_id": st.just("t1"),
    "content": st.one_of(st.just("done"), st.lists(st.one_of(_text, _image), max_size=3))})
_tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("t1"), "name": st.just("f"),
                                   "input": st.just({})})
_block = st.one_of(_text, _image, _tool_result, _tool_use)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                  "content": st.one_of(st.just("hello"), st.lists(_block, min_size=1, max_size=4))})
BODY = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.just(4),
                              "messages": st.lists(_message, min_size=1, max_size=3)})
CFG = GatewayConfig(lms="lm:1", max_images=100)


def _vllm_images(body: dict) -> list[str] | None:
    """The image URLs vLLM's converter puts in its chat request, in order; None where vLLM refuses the body."""
    try:
        request = protocol.AnthropicMessagesRequest.model_validate(copy.deepcopy(body))
    except Exception:  # noqa: BLE001 - vLLM refuses it (400) before converting
        return None
    chat = serving.AnthropicServingMessages.to_chat_completion_request(request)
    urls = []
    for m in chat.messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                urls.append(part["image_url"]["url"])
    return urls


def _sent_on(body: dict, n: int) -> dict:
    """The body the gateway sends the LM (``OpenAICall.for_lm().render``) for ``n`` images of made-up bytes."""
    call = parse_openai("messages", json.dumps(body).encode(), CFG)
    req = lm_pb2.GenerateRequest(request_id="r")
    media = [Media(bytes([k]) * 8, f"{k:064x}", "image") for k in range(n)]
    for m in media:
        req.items.add(modality="image", identifier=m.identifier)
    return json.loads(call.for_lm().render(req, media))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(BODY)
def test_the_gateway_finds_the_images_vllms_converter_sends(body):
    want = _vllm_images(body)
    try:
        found = [p.source for p in anthropic_media_parts(body["messages"])]
    except PartError:
        # The gateway refuses (400) an image with no usable source, where vLLM refuses the body or passes
        # on an empty or data-less URL that its media loader then refuses (400 too).
        assert want is None or any(u == "" or u.endswith(";base64,") for u in want), want
        return
    if want is None:  # vLLM refuses the body: so it does the body the gateway sends on
        assert _vllm_images(_sent_on(body, len(found))) is None
        return
    assert found == want
    sent = _vllm_images(_sent_on(body, len(found)))
    assert sent == [f"data:image/png;base64,{base64.b64encode(bytes([k]) * 8).decode()}" for k in range(len(found))]


def test_a_base64_image_of_any_declared_media_type_is_read_as_vllm_reads_it():
    """vLLM's converter makes ``data:<media_type>;base64,...`` of it whatever the type, and its image loader
    does not read the type (``ImageMediaIO.load_base64``): the gateway loads the bytes (and sniffs them)."""
    png = base64.b64encode(image_bytes("PNG")).decode()
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": png}}]}]}
    assert _vllm_images(body) == [f"data:text/plain;base64,{png}"]
    call = parse_openai("messages", json.dumps(body).encode(), CFG)
    datas = asyncio.run(load_images(call.sources, CFG, None, call.modalities))
    assert datas == [image_bytes("PNG")]
