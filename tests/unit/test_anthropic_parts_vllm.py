"""The gateway reads an Anthropic Messages body's images (``services.gateway.parts.anthropic_media_parts``)
as vLLM 0.32's converter does (``AnthropicServingMessages.to_chat_completion_request``, which the LM's
vLLM runs): generated bodies (hypothesis), validated by vLLM's own request model as `vllm serve`
validates them, converted by vLLM, and the images vLLM's chat request then carries must be exactly
the ones the gateway found, in order, with the same URLs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.gateway.parts import PartError, anthropic_media_parts

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


def _vllm_images(body: dict) -> list[str] | None:
    try:
        request = protocol.AnthropicMessagesRequest.model_validate(body)
    except Exception:  # noqa: BLE001 - vLLM refuses it (400) before converting: nothing to compare
        return None
    chat = serving.AnthropicServingMessages.to_chat_completion_request(request)
    urls = []
    for m in chat.messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                urls.append(part["image_url"]["url"])
    return urls


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(BODY)
def test_the_gateway_finds_the_images_vllms_converter_sends(body):
    want = _vllm_images(body)
    assume(want is not None)
    try:
        found = [p.source for p in anthropic_media_parts(body["messages"])]
    except PartError:
        # The gateway refuses (400) an image with no usable source, where vLLM would pass on an
        # empty or data-less URL that its media loader then refuses.
        assert any(u == "" or u.endswith(";base64,") for u in want), want
        return
    assert found == want
