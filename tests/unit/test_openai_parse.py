"""OpenAI request parsing and the gRPC -> HTTP error mapping (no server)."""

import asyncio
import base64
import hashlib

import grpc
import pytest
from helpers import data_url, image_bytes

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.gateway.config import GatewayConfig
from services.gateway.openai_api import (
    ApiError,
    check_sampling,
    engine_request_id,
    from_grpc,
    load_media,
    loads_strict,
    media_api_error,
    parse_chat,
    parse_completion,
)

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="x:1")
PNG = image_bytes("PNG")


def chat(*content, **extra):
    """A one-message chat body; each content item is a string or a part dict."""
    parts = [c if isinstance(c, dict) else {"type": "text", "text": c} for c in content]
    return {"messages": [{"role": "user", "content": parts}], **extra}


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def parse_and_load(body, cfg=CFG):
    """What OpenAIRoutes.chat does before dispatch: parse_chat, then load_media (no fetcher: the
    data: URLs here need none), a refused image becoming the ApiError the route answers."""
    req, urls = parse_chat(body, cfg)
    try:
        return req, asyncio.run(load_media(req, urls, cfg, None))
    except MediaError as e:
        raise media_api_error(e) from None


def api_error(body, cfg=CFG, parse=None) -> ApiError:
    with pytest.raises(ApiError) as e:
        (parse or (lambda b: parse_and_load(b, cfg)))(body)
    return e.value


def test_text_only_messages():
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    req, urls = parse_chat(body, CFG)
    assert urls == [] and len(req.items) == 0
    assert req.request_id.startswith("chatcmpl-")
    assert [(m.role, [p.text for p in m.content]) for m in req.chat.messages] == [
        ("system", ["be brief"]),
        ("user", ["hi"]),
    ]


def test_request_ids_are_unique():
    assert parse_chat(chat("a"), CFG)[0].request_id != parse_chat(chat("a"), CFG)[0].request_id


def test_image_data_url_becomes_an_item_identified_by_its_sha256():
    req, media = parse_and_load(chat("what is this?", image(data_url(PNG))))
    ident = hashlib.sha256(PNG).hexdigest()
    assert [(m.data, m.identifier, m.modality) for m in media] == [(PNG, ident, "image")]
    assert [(i.modality, i.identifier, i.data) for i in req.items] == [("image", ident, PNG)]
    parts = req.chat.messages[0].content
    assert [p.WhichOneof("part") for p in parts] == ["text", "item_index"]
    assert parts[1].item_index == 0


def test_several_images_are_indexed_in_order_and_a_plain_string_url_works():
    jpg = image_bytes("JPEG")
    body = chat(image(data_url(PNG)), {"type": "image_url", "image_url": data_url(jpg, "image/jpeg")})
    req, media = parse_and_load(body)
    assert [p.item_index for p in req.chat.messages[0].content] == [0, 1]
    assert [m.identifier for m in media] == [hashlib.sha256(PNG).hexdigest(), hashlib.sha256(jpg).hexdigest()]


@pytest.mark.parametrize(
    "body, needle",
    [
        ([], "JSON object"),
        ({}, "'messages' is required"),
        ({"messages": []}, "'messages' is required"),
        ({"messages": "hi"}, "'messages' is required"),
        ({"messages": [{"content": "hi"}]}, "'role'"),
        ({"messages": [{"role": "user", "content": None}]}, "string or a list of parts"),
        (chat({"type": "audio_url", "audio_url": {"url": "x"}}), "unsupported part type 'audio_url'"),
        (chat({"type": "text", "text": 5}), "unsupported part type 'text'"),
        (chat("ok", {"nope": 1}), "unsupported part type None"),
        (chat({"type": "image_url", "image_url": {}}), "image_url.url is required"),
    ],
    ids=["not-object", "missing", "empty", "string", "no-role", "no-content", "audio", "bad-text", "no-type", "no-url"],
)
def test_malformed_chat_requests_are_400(body, needle):
    e = api_error(body)
    assert e.status == 400 and e.type == "invalid_request_error"
    assert needle in e.message


def test_a_part_that_is_not_a_dict_is_400():
    e = api_error({"messages": [{"role": "user", "content": ["just a string"]}]})
    assert e.status == 400 and "content[0]: unsupported part type None" in e.message


@pytest.mark.parametrize(
    "url, needle",
    [
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "expected image/*"),
        ("data:;base64,AAAA", "expected image/*"),
        ("http://example.com/cat.png", "no media fetcher"),  # with one, see tests/*/test_fetch.py
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("ftp://example.com/cat.png", "scheme 'ftp' is not allowed"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a recognised image"),
        ("data:image/png," + "x" * 8, "must be base64-encoded"),
        ("data:image/png;base64,@@not-base64@@", "not valid base64"),
        ("data:image/png;base64,AAA", "not valid base64"),  # bad padding
    ],
    ids=["text-plain", "no-mime", "http-no-fetcher", "file", "ftp", "not-an-image", "not-base64-encoded", "garbage",
         "padding"],
)
def test_bad_image_urls_are_400(url, needle):
    e = api_error(chat(image(url)))
    assert e.status == 400 and e.param == "image_url"
    assert needle in e.message


def test_non_image_data_url_message_mentions_image():
    e = api_error(chat(image("data:text/plain;base64," + base64.b64encode(b"hello").decode())))
    assert "image" in e.message and "text/plain" in e.message


def test_too_many_images_is_400():
    cfg = GatewayConfig(lms="x:1", max_images=2)
    parse_and_load(chat(*[image(data_url(PNG))] * 2), cfg)  # the limit itself is fine
    e = api_error(chat(*[image(data_url(PNG))] * 3), cfg=cfg)
    assert e.status == 400 and "at most 2 images" in e.message


def test_an_oversized_image_is_413():
    cfg = GatewayConfig(lms="x:1", max_image_bytes=len(PNG) - 1)
    e = api_error(chat(image(data_url(PNG))), cfg=cfg)
    assert e.status == 413 and e.param == "image_url"


def test_sampling_fields_are_copied():
    req, _ = parse_chat(chat("hi", max_tokens=16, temperature=0.5, top_p=0.9, seed=42, n=1, stop="END"), CFG)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.n, list(s.stop)) == (16, 0.5, 42, 1, ["END"])
    assert s.top_p == pytest.approx(0.9)  # stored as float32


def test_unset_sampling_fields_stay_unset_and_stop_lists_are_kept():
    s = parse_chat(chat("hi", stop=["a", "b"]), CFG)[0].sampling
    assert list(s.stop) == ["a", "b"] and s.max_tokens == 0
    assert not s.HasField("temperature") and not s.HasField("top_p") and not s.HasField("seed")


def test_max_completion_tokens_wins_over_max_tokens():
    s = parse_chat(chat("hi", max_tokens=5, max_completion_tokens=7), CFG)[0].sampling
    assert s.max_tokens == 7


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": [1]}, "top_p"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 1]}, "stop"),
        ({"seed": "abc"}, "seed"),
        ({"max_tokens": 1 << 40}, None),  # beyond uint32
    ],
    ids=str,
)
def test_bad_sampling_fields_are_400(extra, param):
    e = api_error(chat("hi", **extra))
    assert e.status == 400 and e.param == param


def test_completion_prompt():
    req = parse_completion({"prompt": "Once upon", "max_tokens": 3})
    assert req.prompt == "Once upon" and req.sampling.max_tokens == 3
    assert req.request_id.startswith("cmpl-") and req.WhichOneof("input") == "prompt"
    assert parse_completion({"prompt": ["one string"]}).prompt == "one string"


@pytest.mark.parametrize("body", [{}, {"prompt": 3}, {"prompt": ["a", "b"]}, {"prompt": [1]}, "text"], ids=str)
def test_bad_completion_prompts_are_400(body):
    e = api_error(body, parse=parse_completion)
    assert e.status == 400


@pytest.mark.parametrize(
    "code, status, type_",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.FAILED_PRECONDITION, 502, "server_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.UNKNOWN, 500, "server_error"),
        (grpc.StatusCode.DATA_LOSS, 500, "server_error"),
    ],
    ids=lambda v: v.name if isinstance(v, grpc.StatusCode) else None,
)
def test_from_grpc_maps_status_codes(code, status, type_):
    e = from_grpc(grpc.aio.AioRpcError(code, None, None, "details here"))
    assert (e.status, e.type, e.message) == (status, type_, "details here")


def test_from_grpc_without_details_uses_the_code_name():
    e = from_grpc(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, None))
    assert e.message == "UNAVAILABLE"


def test_ignore_eos_passes_through_only_when_true():
    from services.gateway.config import GatewayConfig
    from services.gateway.openai_api import parse_chat

    cfg = GatewayConfig(lms="x:1")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(dict(body, ignore_eos=True), cfg)[0].sampling.ignore_eos is True
    assert parse_chat(dict(body, ignore_eos="yes"), cfg)[0].sampling.ignore_eos is False
    assert parse_chat(body, cfg)[0].sampling.ignore_eos is False


@pytest.mark.parametrize("raw", [b'{"messages": [], "temperature": NaN}', b'{"top_p": Infinity}',
                                 b'{"temperature": -Infinity}'], ids=str)
def test_a_body_with_nan_or_infinity_literals_is_not_json(raw):
    with pytest.raises(ApiError) as e:
        loads_strict(raw)
    assert e.value.status == 400 and "is not a JSON number" in e.value.message


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e300}, "temperature"),  # a float32 overflows to infinity
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 1.9}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"n": 0}, "n"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"max_completion_tokens": 2.5}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": "include_usage"}, "stream_options"),
        ({"stream_options": ["include_usage"]}, "stream_options"),
        ({"stream": True, "stream_options": 1}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ],
    ids=str,
)
def test_non_finite_out_of_range_and_non_integer_fields_are_400_before_anything_starts(extra, param):
    e = api_error(chat("hi", **extra))
    assert e.status == 400 and e.param == param, e.message
    e = api_error(dict(extra, prompt="hi"), parse=parse_completion)
    assert e.status == 400 and e.param == param, e.message


def test_valid_edge_values_pass():
    s = parse_chat(chat("hi", temperature=0, top_p=1, n=1, seed=-3, stream=False, stream_options=None), CFG)[0].sampling
    assert (s.temperature, s.top_p, s.n, s.seed) == (0.0, 1.0, 1, -3)
    parse_chat(chat("hi", stream=True, stream_options={"include_usage": True}), CFG)


def test_a_client_request_id_reaches_the_engines_made_unique():
    a = parse_chat(chat("hi"), CFG, "client-7")[0].request_id
    b = parse_chat(chat("hi"), CFG, "client-7")[0].request_id
    assert a != b and a.startswith("client-7-") and b.startswith("client-7-")
    c = parse_completion({"prompt": "x"}, "client-7").request_id
    assert c.startswith("client-7-") and c not in (a, b)
    assert engine_request_id("", "cmpl").startswith("cmpl-")


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("top_p", float("inf")),
                                          ("top_p", 0.0), ("temperature", -1.0)])
def test_check_sampling_refuses_what_the_grpc_api_would_pass_through(field, value):
    s = lm_pb2.SamplingOptions(**{field: value})
    assert check_sampling(s)[0] == field
    assert check_sampling(lm_pb2.SamplingOptions(temperature=0.7, top_p=0.9, n=1)) is None
