"""An LM attempt's body (services.gateway.lm_body): the media spliced in after ``json.dumps`` are
byte for byte what ``json.dumps`` of the whole body writes, whatever the client's text holds."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.lm_body import Splice
from services.gateway.request import parse_openai
from services.gateway.values import Media
from tests.unit.helpers import data_url, image_bytes

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="lm:1")
PNG, GIF = image_bytes("PNG"), image_bytes("GIF")
# Text a splice must leave alone: a token's shape, quotes, escapes, characters JSON writes raw or escaped.
TEXT = 'epd-splice-0123456789abcdef0123456789abcdef-0. "quoted" \\ é \u2028 \x00 \n'


def _rendered(api: str, body: dict) -> bytes:
    call = parse_openai(api, json.dumps(body).encode(), CFG)
    media = [Media(data, f"{i:064x}", "image") for i, data in enumerate((PNG, GIF))]
    req = lm_pb2.GenerateRequest(request_id="r")
    for m in media:
        req.items.add(modality="image", identifier=m.identifier)
    return call.for_lm(media).render(req)


def test_a_chat_body_is_what_json_dumps_writes():
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": data_url(GIF, "image/gif")}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(GIF).decode()}}]}]}
    want = copy.deepcopy(body)  # the items are the media given (here not the client's): each a PNG data: URL
    for k, data in ((1, PNG), (2, GIF)):
        want["messages"][0]["content"][k] = {"type": "image_url", "image_url": {"url": data_url(data)}}
    assert _rendered("chat", body) == json.dumps(want, ensure_ascii=False).encode()


def test_an_anthropic_body_is_what_json_dumps_writes():
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT}, block, copy.deepcopy(block)]}]}
    want = copy.deepcopy(body)
    for k, data in ((1, PNG), (2, GIF)):
        want["messages"][0]["content"][k]["source"]["data"] = base64.b64encode(data).decode()
    assert _rendered("messages", body) == json.dumps(want, ensure_ascii=False).encode()


def test_a_splice_puts_each_item_in_its_own_tokens_place():
    splice = Splice()
    rendered = json.dumps([splice.add(b"one"), "x", splice.add(b"t", b"wo"), splice.add(b"")]).encode()
    assert splice.join(rendered) == b'["one", "x", "two", ""]'
