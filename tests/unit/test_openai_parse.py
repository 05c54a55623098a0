"""OpenAI request parsing (what the gateway reads from a body: its images and stream flag), the
LM body each attempt gets, and the gRPC -> HTTP error mapping (no server). Sampling fields are vLLM's
to validate on the LM (tests/e2e compare its answers with ``vllm serve``'s)."""

import asyncio
import base64
import hashlib
import json

import grpc
import pytest

from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2
from services.common.errors import MediaError
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, from_grpc, media_api_error
from services.gateway.request import OpenAICall, engine_request_id, load_media, loads_strict, parse_openai
from services.gateway.values import Media
from tests.unit.helpers import data_url, image_bytes
from tools.media import make_audio

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="x:1")
PNG = image_bytes("PNG")


def chat(*content, **extra):
    """A one-message chat body; each content item is a string or a part dict."""
    parts = [c if isinstance(c, dict) else {"type": "text", "text": c} for c in content]
    return {"messages": [{"role": "user", "content": parts}], **extra}


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def raw(body) -> bytes:
    return json.dumps(body).encode()


def parse(body, cfg=CFG, api="chat", media=None) -> OpenAICall:
    return parse_openai(api, raw(body), cfg, media)


def parse_and_load(body, cfg=CFG, media=None) -> tuple[OpenAICall, lm_pb2.GenerateRequest, list[Media]]:
    """What OpenAIRoutes._serve does before dispatch: parse_openai, then load_media (no fetcher: the
    data: URLs here need none), a refused image becoming the ApiError the route answers."""
    call = parse(body, cfg, media=media)
    req = lm_pb2.GenerateRequest(request_id="r-1")
    try:
        return call, req, asyncio.run(load_media(call, req, cfg, None))
    except MediaError as e:
        raise media_api_error(e) from None


def api_error(body, cfg=CFG, media=None) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_and_load(body, cfg, media)
    return e.value


def test_text_only_messages_have_no_images_and_the_body_is_kept_as_sent():
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 5, "temperature": 0.5, "some_vllm_field": [1, 2]}
    call, req, media = parse_and_load(body)
    assert (call.api, call.body, call.stream, call.parts, call.sources) == ("chat", body, False, [], [])
    assert media == [] and len(req.items) == 0
    assert json.loads(call.for_lm().render(req, media)) == body


@pytest.mark.parametrize("body, stream", [({"stream": True}, True), ({"stream": False}, False), ({}, False),
                                          ({"stream": "yes"}, False), ({"stream": 1}, False)], ids=str)
def test_only_a_json_true_stream_streams(body, stream):
    """Anything else that is not false is vLLM's to refuse (400), which the gateway answers unstreamed."""
    assert parse(dict(body, prompt="hi"), api="completions").stream is stream
    assert parse(dict(chat("hi"), **body)).stream is stream


@pytest.mark.parametrize("extra, one", [({}, True), ({"use_beam_search": False}, True), ({"background": False}, True),
                                        ({"use_beam_search": True}, False), ({"use_beam_search": "true"}, False),
                                        ({"background": True}, False)], ids=str)
def test_a_request_of_several_engine_calls_is_not_split_between_prefill_and_decode(extra, one):
    """Beam search calls the engine per beam per step, a background response outlives its call: neither goes
    E -> P -> D (read loosely: a value vLLM might read as false only costs the split)."""
    assert parse(dict(chat("hi"), **extra)).one_engine_call() is one
    assert parse(dict(extra, prompt="hi"), api="completions").one_engine_call() is one


def test_completions_bodies_are_not_searched_for_images():
    body = {"prompt": "Once upon", "messages": [{"role": "user", "content": [image("data:,x")]}]}
    call = parse(body, api="completions")
    assert call.parts == [] and call.api == "completions" and call.body == body


def test_image_data_url_becomes_an_item_identified_by_its_sha256():
    call, req, media = parse_and_load(chat("what is this?", image(data_url(PNG))))
    ident = hashlib.sha256(PNG).hexdigest()
    assert [(p.message, p.part) for p in call.parts] == [(0, 1)]
    assert [(m.data, m.identifier, m.modality) for m in media] == [(PNG, ident, "image")]
    assert [(i.modality, i.identifier, i.HasField("source")) for i in req.items] == [("image", ident, False)]


def test_several_images_are_found_in_order_across_messages_and_an_untyped_plain_string_url_works():
    """vLLM reads a part without ``type`` by its keys, and an untyped ``image_url`` may be a plain string."""
    jpg = image_bytes("JPEG")
    body = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, image(data_url(PNG))]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"image_url": data_url(jpg, "image/jpeg")}, "odd part"]},
    ]}
    call, req, media = parse_and_load(body)
    assert [(p.message, p.part) for p in call.parts] == [(1, 1), (3, 0)]
    assert call.sources == [data_url(PNG), data_url(jpg, "image/jpeg")]
    assert [m.identifier for m in media] == [hashlib.sha256(PNG).hexdigest(), hashlib.sha256(jpg).hexdigest()]
    assert [i.identifier for i in req.items] == [m.identifier for m in media]


@pytest.mark.parametrize("body", [[], "text", 3, None, [{"messages": []}]], ids=str)
def test_a_body_that_is_not_a_json_object_is_400(body):
    for api in ("chat", "completions"):
        with pytest.raises(ApiError) as e:
            parse(body, api=api)
        assert e.value.status == 400 and "JSON object" in e.value.message


@pytest.mark.parametrize("raw_body", [b"", b"{", b"not json", b"\xff\xfe", b'{"a": 1} x'], ids=str)
def test_a_body_that_is_not_json_is_400(raw_body):
    with pytest.raises(ApiError) as e:
        parse_openai("chat", raw_body, CFG)
    assert e.value.status == 400 and "not valid JSON" in e.value.message


@pytest.mark.parametrize("body", [{}, {"messages": "hi"}, {"messages": [5, None, "x"]},
                                  {"messages": [{"role": "user", "content": None}]},
                                  {"messages": [{"role": "user", "content": [None, 1, {"no": "type"}]}]}], ids=str)
def test_malformed_messages_are_left_to_vllm(body):
    """The gateway finds no image in them and passes them on: vLLM answers them (400) as it would."""
    call = parse(body)
    assert call.parts == [] and call.body == body


@pytest.mark.parametrize("kind", ["image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil"])
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "by-key"])
def test_pre_computed_inputs_are_400_typed_or_not(kind, typed):
    part = {"type": kind, kind: "AAAA"} if typed else {kind: "AAAA"}
    e = api_error(chat("hi", part))
    assert e.status == 400 and e.param == "messages"
    assert f"messages[0].content[1]: {kind} parts are not served" in e.message


@pytest.mark.parametrize("part", [{"type": "file", "file": {"file_id": "x"}}, {"type": 3}, {"type": "image"}])
def test_part_types_vllm_does_not_know_are_left_to_vllm(part):
    """vLLM refuses these itself (an unsupported or invalid type); nothing in them is media."""
    assert parse(chat("hi", part)).parts == []


@pytest.mark.parametrize("part", [
    {"type": "text", "text": "hi", "uuid": "abc"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "0" * 64},
    {"image_url": None, "uuid": "abc"},
    {"type": "image_url", "image_url": None, "uuid": 7},
], ids=["on-text", "on-image", "uuid-only", "number"])
def test_a_client_uuid_on_any_part_is_400(part):
    e = api_error(chat("hi", part))
    assert e.status == 400 and "messages[0].content[1]: a client may not set uuid" in e.message


@pytest.mark.parametrize("part, modality", [
    ({"image_url": {"url": "http://203.0.113.9/a.png"}}, "image"),
    ({"image_url": "http://203.0.113.9/a.png", "text": "x"}, "image"),
    ({"video_url": {"url": "http://203.0.113.9/a.mp4"}, "audio_url": {"url": "http://203.0.113.9/a.wav"}}, "audio"),
    ({"type": "input_image", "image_url": "http://203.0.113.9/a.png", "detail": "auto"}, "image"),
], ids=["untyped", "untyped-with-text", "key-order", "responses-input-image"])
def test_parts_vllm_reads_as_media_by_their_keys_are_media_here_too(part, modality):
    call = parse(chat("hi", part))
    assert [(p.message, p.part) for p in call.parts] == [(0, 1)] and call.modalities == [modality]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": None},
    {"type": "image_url"},
    {"type": "image_url", "image_url": {}},
    {"type": "image_url", "image_url": {"url": ""}},
    {"type": "image_url", "image_url": {"url": 5}},
    {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
], ids=["null", "no-image-url", "no-url", "empty-url", "non-string-url", "typed-plain-string"])
def test_an_image_part_without_a_url_is_400(part):
    """vLLM's parser refuses all but the empty URL (the gateway's own refusal: a media part needs a source)."""
    e = api_error(chat("hi", part))
    assert e.status == 400 and e.message.startswith("messages[0].content[1]: ")
    assert ("image_url needs a URL" if part.get("image_url") == {"url": ""} else "not a valid image_url part") in e.message


@pytest.mark.parametrize("part, needle", [
    ({"type": "input_image", "image_url": {"url": "data:image/png;base64,AAAA"}, "detail": "auto"},
     "image_url: Input should be a valid string"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "detail: Field required"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "ultra"}, "detail: Input should be"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "ultra"}},
     "image_url.detail: Input should be"),
], ids=["input-image-object-url", "input-image-no-detail", "input-image-unknown-detail", "image-url-unknown-detail"])
def test_a_typed_image_part_vllms_parser_refuses_is_400_not_rewritten_into_one_it_takes(part, needle):
    """vLLM validates a typed image part with the openai package's type (``chat_utils.MM_PARSER_MAP``:
    ``_ResponsesInputImageParser``, ``_ImageParser``) and answers 400; the gateway must not rewrite it into
    an ``image_url`` part vLLM would take."""
    parsers = pytest.importorskip("vllm.renderers.chat_utils").MM_PARSER_MAP
    with pytest.raises(ValueError):  # pydantic's ValidationError: vLLM's 400
        parsers[part["type"]](part)
    e = api_error(chat("hi", part))
    assert e.status == 400 and e.message.startswith("messages[0].content[1]: not a valid ") and needle in e.message


@pytest.mark.parametrize(
    "url, needle",
    [
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "not a recognised image"),
        ("data:;base64,AAAA", "not a recognised image"),
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


@pytest.mark.parametrize("mime", ["text/plain", "application/octet-stream", ""])
def test_a_data_urls_declared_type_is_not_read_as_vllm_does_not_read_it(mime):
    """vLLM's ``ImageMediaIO.load_base64`` / ``AudioMediaIO.load_base64`` decode the bytes whatever the
    declared type; the gateway sniffs them."""
    call, _, media = parse_and_load(chat(image(data_url(PNG, mime)), audio(data_url(WAV, mime))))
    assert [m.modality for m in media] == ["image", "audio"] and media[0].data == PNG and media[1].data == WAV


def test_too_many_images_is_400_before_any_is_loaded():
    cfg = GatewayConfig(lms="x:1", max_images=2)
    parse_and_load(chat(*[image(data_url(PNG))] * 2), cfg)  # the limit itself is fine
    e = api_error(chat(*[image(data_url(PNG))] * 3), cfg=cfg)
    assert e.status == 400 and "at most 2 images" in e.message
    with pytest.raises(ApiError, match="at most 2 images"):  # counted across messages, refused while parsing
        parse({"messages": [{"role": "user", "content": [image("http://x/a.png")] * 2}] * 2}, cfg)


def test_an_oversized_image_is_413():
    cfg = GatewayConfig(lms="x:1", max_image_bytes=len(PNG) - 1)
    e = api_error(chat(image(data_url(PNG))), cfg=cfg)
    assert e.status == 413 and e.param == "image_url"


def test_epd_media_refs_take_the_grpc_apis_raw_images():
    jpg = image_bytes("JPEG")
    call, req, media = parse_and_load(chat(image("epd-media:1"), image("epd-media:0"), image("epd-media:1")),
                                      media=[PNG, jpg])
    assert call.sources == [jpg, PNG, jpg]
    assert [m.data for m in media] == [jpg, PNG, jpg]
    assert [i.identifier for i in req.items] == [hashlib.sha256(d).hexdigest() for d in (jpg, PNG, jpg)]


@pytest.mark.parametrize("url, media", [("epd-media:2", [PNG, PNG]), ("epd-media:", [PNG]), ("epd-media:x", [PNG]),
                                        ("epd-media:-1", [PNG]), ("epd-media:0", None)], ids=str)
def test_an_epd_media_ref_that_names_nothing_is_400(url, media):
    """Also over REST (no media): such a URL names nothing there."""
    e = api_error(chat(image(url)), media=media)
    assert e.status == 400 and f"{url!r} names no media item" in e.message


def test_epd_media_bytes_are_checked_like_any_image():
    e = api_error(chat(image("epd-media:0")), media=[b"not an image"])
    assert e.status == 400 and e.param == "image_url" and "not a recognised image" in e.message


def _laid_out(req: lm_pb2.GenerateRequest, k: int) -> None:
    """Item ``k`` as the orchestrator leaves it when an encoder laid it out."""
    req.items[k].source.CopyFrom(transfer_pb2.ItemSource(transfer_endpoint="e:1", encoder_id="enc", num_embeds=4,
                                                   embed_width=8, dtype=transfer_pb2.BFLOAT16,
                                                   placeholder_token_ids=[7], prompt_token_ids=[7, 7, 7, 7],
                                                   is_embed=b"\x01"))


def test_lm_body_puts_uuid_only_parts_data_urls_and_leaves_the_rest_as_sent():
    jpg = image_bytes("JPEG")
    body = chat("compare", image(data_url(PNG)), image("epd-media:0"), max_tokens=3)
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    sent = json.loads(json.dumps(body))
    call, req, media = parse_and_load(body, media=[jpg])
    _laid_out(req, 0)  # an encoder laid them out: the LM splices the layouts, never sees the bytes
    _laid_out(req, 1)
    out = json.loads(call.for_lm().render(req, media))
    content = out["messages"][1]["content"]
    assert content[0] == {"type": "text", "text": "compare"}
    assert content[1] == {"type": "image_url", "image_url": None, "uuid": hashlib.sha256(PNG).hexdigest()}
    assert content[2] == {"type": "image_url", "image_url": None, "uuid": hashlib.sha256(jpg).hexdigest()}
    assert {k: v for k, v in out.items() if k != "messages"} == {"max_tokens": 3}
    assert out["messages"][0] == sent["messages"][0]
    assert body == sent and call.body == sent  # the client's body is never changed


def test_an_item_without_a_layout_sends_every_item_as_bytes():
    """The LM lays a prompt out from the encoders' layouts only when every item has one; otherwise its
    processor lays out the whole prompt and needs every item's bytes (the embeddings still come from
    the encoders: items with a source keep their content hash as uuid)."""
    jpg = image_bytes("JPEG")
    call, req, media = parse_and_load(chat("compare", image(data_url(PNG)), image("epd-media:0"),
                                           image(data_url(PNG)), max_tokens=3), media=[jpg])
    _laid_out(req, 0)
    req.items[1].source.CopyFrom(transfer_pb2.ItemSource(transfer_endpoint="e:1", encoder_id="enc", num_embeds=4))
    # items[2]: no source, the LM encodes it itself
    content = json.loads(call.for_lm().render(req, media))["messages"][0]["content"]
    assert content[1] == {"type": "image_url", "image_url": {"url": data_url(PNG)},
                          "uuid": hashlib.sha256(PNG).hexdigest()}
    assert content[2] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                    + base64.b64encode(jpg).decode()},
                          "uuid": hashlib.sha256(jpg).hexdigest()}
    # No source: a data: URL without uuid (the LM hashes it as vLLM does).
    assert content[3] == {"type": "image_url", "image_url": {"url": data_url(PNG)}}


def test_lm_body_is_made_afresh_for_each_attempt():
    """A retry may lay items out differently (another encoder): each call reads the items as they are now."""
    call, req, media = parse_and_load(chat(image(data_url(PNG))))
    first = json.loads(call.for_lm().render(req, media))["messages"][0]["content"][0]
    _laid_out(req, 0)
    second = json.loads(call.for_lm().render(req, media))["messages"][0]["content"][0]
    assert first == image(data_url(PNG)) and second["image_url"] is None
    assert call.body == chat(image(data_url(PNG)))


def test_lm_body_keeps_non_ascii_text():
    call, req, media = parse_and_load(chat("was ist das? 猫 🐈", image(data_url(PNG))))
    out = call.for_lm().render(req, media)
    assert "猫 🐈".encode() in out and json.loads(out)["messages"][0]["content"][0]["text"] == "was ist das? 猫 🐈"


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


@pytest.mark.parametrize("raw", [b'{"messages": [], "temperature": NaN}', b'{"top_p": Infinity}',
                                 b'{"temperature": -Infinity}'], ids=str)
def test_a_body_with_nan_or_infinity_literals_is_not_json(raw):
    with pytest.raises(ApiError) as e:
        loads_strict(raw)
    assert e.value.status == 400 and "is not a JSON number" in e.value.message


def test_a_nan_inside_a_chat_body_is_refused_by_parse_openai():
    with pytest.raises(ApiError) as e:
        parse_openai("chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', CFG)
    assert e.value.status == 400 and "NaN is not a JSON number" in e.value.message


def test_a_client_request_id_reaches_the_engines_made_unique():
    a, b = engine_request_id("client-7", "chatcmpl"), engine_request_id("client-7", "chatcmpl")
    assert a != b and a.startswith("client-7-") and b.startswith("client-7-")
    c, d = engine_request_id("", "cmpl"), engine_request_id("", "chatcmpl")
    assert c.startswith("cmpl-") and d.startswith("chatcmpl-") and c[5:] != d[9:]


WAV = make_audio(0, 0.5)


def audio(url):
    return {"type": "audio_url", "audio_url": {"url": url}}


def input_audio(data: bytes, fmt="wav"):
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_audio_parts_are_read_in_order_with_images():
    """OpenAI's input_audio and vLLM's audio_url parts are items like images: each one's modality, its
    bytes, its content hash."""
    flac = make_audio(1, 0.3, fmt="FLAC")
    call, req, media = parse_and_load(chat("hear", audio(data_url(WAV, "audio/wav")), image(data_url(PNG)),
                                           input_audio(flac, "flac")))
    assert call.modalities == ["audio", "image", "audio"]
    assert [(m.modality, m.data) for m in media] == [("audio", WAV), ("image", PNG), ("audio", flac)]
    assert [(i.modality, i.identifier) for i in req.items] == [
        ("audio", hashlib.sha256(WAV).hexdigest()), ("image", hashlib.sha256(PNG).hexdigest()),
        ("audio", hashlib.sha256(flac).hexdigest())]


@pytest.mark.parametrize("part, needle", [
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data is required"),
    ({"type": "input_audio", "input_audio": "x"}, "input_audio.data is required"),
    (input_audio(WAV, "aiff"), "input_audio.format must be one of wav, mp3, flac, ogg"),
    ({"type": "audio_url", "audio_url": None}, "audio_url needs a URL"),
], ids=["no-data", "not-an-object", "format", "no-url"])
def test_malformed_audio_parts_are_400(part, needle):
    e = api_error(chat("hi", part))
    assert e.status == 400 and needle in e.message


@pytest.mark.parametrize("url, needle", [
    (data_url(b"RIFF\x00\x00\x00\x00WAVEjunk", "audio/wav"), "header cannot be read"),
    (data_url(b"hello there", "audio/wav"), "not a recognised audio file"),
    (data_url(b"", "audio/wav"), "audio is empty"),
    ("file:///etc/passwd", "scheme 'file' is not allowed"),
], ids=["broken-header", "not-audio", "empty", "file"])
def test_bad_audio_is_400_naming_audio(url, needle):
    e = api_error(chat(audio(url)))
    assert e.status == 400 and e.param == "audio_url" and needle in e.message


def test_audio_limits_count_duration_and_bytes():
    cfg = GatewayConfig(lms="x:1", max_audios=1, max_audio_seconds=0.4, max_audio_bytes=len(WAV) - 1)
    e = api_error(chat(input_audio(make_audio(2, 0.1)), input_audio(make_audio(3, 0.1))), cfg=cfg)
    assert e.status == 400 and "at most 1 audio clips" in e.message
    e = api_error(chat(audio(data_url(WAV, "audio/wav"))), cfg=GatewayConfig(lms="x:1", max_audio_seconds=0.4))
    assert e.status == 400 and "0.5 s long" in e.message and "--max-audio-seconds" in e.message
    e = api_error(chat(audio(data_url(WAV, "audio/wav"))), cfg=cfg)
    assert e.status == 413 and e.param == "audio_url"


def test_lm_body_sends_audio_as_audio_url_parts():
    call, req, media = parse_and_load(chat(input_audio(WAV), "which?"))
    _laid_out(req, 0)
    content = json.loads(call.for_lm().render(req, media))["messages"][0]["content"]
    assert content[0] == {"type": "audio_url", "audio_url": None, "uuid": hashlib.sha256(WAV).hexdigest()}
    # Not laid out: the LM decodes the bytes the gateway read, sent with the format's own media type.
    call, req, media = parse_and_load(chat(audio(data_url(WAV, "audio/x-wav")), "which?"))
    content = json.loads(call.for_lm().render(req, media))["messages"][0]["content"]
    assert content[0] == {"type": "audio_url", "audio_url": {"url": data_url(WAV, "audio/wav")}}


def test_video_parts_are_items_with_video_rules():
    from tools.media import make_video

    mp4 = make_video(1, frames=4)
    call, req, media = parse_and_load(chat({"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}},
                                           image(data_url(PNG))))
    assert call.modalities == ["video", "image"] and [i.modality for i in req.items] == ["video", "image"]
    content = json.loads(call.for_lm().render(req, media))["messages"][0]["content"]
    assert content[0] == {"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}}
    e = api_error(chat({"type": "video_url", "video_url": {"url": data_url(mp4, "image/png")}}))
    assert e.status == 400 and e.param == "video_url" and "expected video/*" in e.message
    e = api_error(chat(*[{"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}}] * 2),
                  cfg=GatewayConfig(lms="x:1", max_videos=1))
    assert e.status == 400 and "at most 1 videos per request (--max-videos)" in e.message


def test_the_grpc_apis_raw_media_may_be_audio():
    call, req, media = parse_and_load(chat(audio("epd-media:1"), image("epd-media:0")), media=[PNG, WAV])
    assert [(m.modality, m.data) for m in media] == [("audio", WAV), ("image", PNG)]
    e = api_error(chat(audio("epd-media:0")), media=[PNG])  # an image's bytes in an audio part
    assert e.status == 400 and e.param == "audio_url" and "not a recognised audio file" in e.message


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED])
def test_a_deployment_faults_details_reach_a_caller_only_with_epd_facts(code):
    from services.gateway.errors import from_grpc

    e = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "encoder 10.1.2.3:50051: boom")
    hidden = from_grpc(e, "req-7", facts=False)
    assert "10.1.2.3" not in hidden.message and "req-7" in hidden.message
    assert from_grpc(e, "req-7", facts=True).message == "encoder 10.1.2.3:50051: boom"
    assert hidden.status == from_grpc(e).status


def test_a_requests_own_error_reaches_the_caller_unchanged_without_epd_facts():
    from services.gateway.errors import from_grpc

    e = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                             "image 0: its uuid is not the content hash of its bytes")
    assert from_grpc(e, "r", facts=False).message == "image 0: its uuid is not the content hash of its bytes"


def test_a_tenants_media_are_named_in_its_namespace_and_a_gateway_without_keys_names_them_as_before():
    from services.common.media import content_id
    from services.gateway.request import tenant_namespace

    assert tenant_namespace("") == "" and tenant_namespace("acme") == "acme:"
    named = {}
    for tenant in ("", "acme", "lab", "acme"):
        call = parse(chat("what?", image(data_url(PNG))))
        call.salt_tenant = tenant  # what RequestCore.admit sets for a keyed request
        req = lm_pb2.GenerateRequest(request_id="r-1")
        (m,) = asyncio.run(load_media(call, req, CFG, None))
        assert req.namespace == tenant_namespace(tenant) and req.items[0].identifier == m.identifier
        assert named.setdefault(tenant, m.identifier) == m.identifier  # the same tenant, the same item
    assert named[""] == hashlib.sha256(PNG).hexdigest() == content_id(PNG)
    assert named["acme"] == content_id(PNG, "acme:") and len(set(named.values())) == 3
