"""Issue 22: the gateway's reading of the other APIs' bodies (Responses input items, Anthropic
Messages image blocks, tokenize) and the LM body each attempt gets. vLLM's own readers are checked
against these in tests/integration/test_surface_parts_vllm.py; the answers against `vllm serve` in
tests/e2e/test_openai_parity.py."""

import asyncio
import base64
import hashlib
import json

import pytest

from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2
from services.common.routes import API, APIS
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, error_body
from services.gateway.parts import anthropic_media_parts
from services.gateway.request import load_media, parse_openai
from tests.unit.helpers import data_url, image_bytes

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
        item.source.CopyFrom(transfer_pb2.ItemSource(transfer_endpoint="e:1", num_embeds=1, embed_width=4,
                                               placeholder_token_ids=[5],
                                               prompt_token_ids=[5]))


def test_every_api_has_a_route_and_only_chat_and_completions_are_named_to_the_lm():
    assert {a.lm_api for a in APIS} == {"chat", "completions", "http"}
    assert [a.name for a in APIS if a.lm_api != "http"] == ["chat", "completions"]
    assert len({(a.method, a.path) for a in APIS}) == len(APIS)


def test_responses_input_images_carry_their_id_and_their_bytes():
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)},
                                                   {"type": "input_text", "text": "hi"}]}], "stream": True}
    call, req, media = _load("responses", body)
    assert [(p.container, p.message, p.part) for p in call.parts] == [("input", 0, 0)] and call.stream
    assert [i.identifier for i in req.items] == [IDENT]
    _laid_out(req)
    sent = json.loads(call.for_lm().render(req, media))
    # The bytes go with the id: vLLM stores the input as given and renders it again for a follow-up.
    assert sent["input"][0]["content"][0] == {"type": "input_image", "image_url": data_url(PNG), "uuid": IDENT}
    assert sent["request_id"] == call.response_id  # the id the gateway minted names the stored response


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
    sent = json.loads(call.for_lm().render(req, media))
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
    sent = json.loads(call.for_lm().render(req, media))
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


def test_a_responses_request_gets_an_id_the_gateway_minted_and_may_not_choose_one():
    from epd.lm.v1 import lm_pb2
    from services.gateway.request import RESPONSE_ID_RE

    call = parse_openai("responses", b'{"input": "hi"}', CFG)
    assert RESPONSE_ID_RE.fullmatch(call.response_id)
    body = json.loads(call.for_lm().render(lm_pb2.GenerateRequest(), []))
    assert body["request_id"] == call.response_id  # vLLM names and stores the response by it
    with pytest.raises(ApiError) as e:
        parse_openai("responses", b'{"input": "hi", "request_id": "resp_victim"}', CFG)
    assert e.value.status == 400 and e.value.param == "request_id"
    assert parse_openai("chat", b'{"messages": [], "request_id": "mine"}', CFG).response_id == ""


def test_a_responses_answers_id_is_read_from_its_body_or_its_first_event():
    from epd.lm.v1 import lm_pb2
    from services.gateway.responses import response_id

    whole = lm_pb2.GenerateResponse(openai=b'{"id": "resp_1", "object": "response"}', http_status=200,
                                    content_type="application/json")
    first_event = lm_pb2.GenerateResponse(
        openai=b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_2"}}\n\n',
        http_status=200, content_type="text/event-stream; charset=utf-8")
    assert response_id(whole) == "resp_1" and response_id(first_event) == "resp_2"
    assert response_id(lm_pb2.GenerateResponse(openai=b"not json")) is None


def test_the_transports_import_the_core_and_not_each_other():
    """One pipeline: REST (openai_api) and the gRPC API (servicer) both go through core and request."""
    import ast
    import pathlib

    gateway = pathlib.Path(__file__).resolve().parents[2] / "services" / "gateway"

    def imports(module: str) -> set[str]:
        tree = ast.parse((gateway / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    rest, grpc_api = imports("openai_api"), imports("servicer")
    assert "services.gateway.servicer" not in rest and "services.gateway.openai_api" not in grpc_api
    assert {"services.gateway.core", "services.gateway.request"} <= rest & grpc_api
    assert not {m for m in imports("core") | imports("request") if m.endswith(("openai_api", "servicer"))}


def _starlette_form(body: bytes, content_type: str) -> list[tuple[str, object]]:
    """The form as vLLM's app reads it (Starlette's parser, the one `vllm serve` runs)."""
    from starlette.requests import Request

    async def main():
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
                 "headers": [(b"content-type", content_type.encode())]}
        form = await Request(scope, receive).form()
        return [(k, v if isinstance(v, str) else (v.filename, await v.read())) for k, v in form.multi_items()]

    return asyncio.run(main())


@pytest.mark.parametrize("api", ["transcriptions", "translations"])
def test_an_upload_travels_to_the_lm_as_the_client_sent_it(api):
    raw = b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--b--\r\n"
    call = parse_openai(api, raw, CFG, content_type="multipart/form-data; boundary=b")
    assert API[api].upload and not API[api].encode and call.parts == []
    assert call.for_lm().render(lm_pb2.GenerateRequest(), []) == raw
    assert call.content_type == "multipart/form-data; boundary=b"
    with pytest.raises(ApiError) as e:
        parse_openai(api, raw, CFG, content_type="multipart/form-data; boundary=b\r\nX-Evil: 1")
    assert e.value.status == 400


def test_the_grpc_apis_audio_fields_become_the_form_vllm_reads():
    fields = {"model": "m", "language": "en", "temperature": 0.5, "stream": True,
              "timestamp_granularities": ["segment", "word"]}
    call = parse_openai("transcriptions", json.dumps(fields).encode(), CFG, media=[b"RIFF-audio"])
    assert _starlette_form(call.upload, call.content_type) == [
        ("model", "m"), ("language", "en"), ("temperature", "0.5"), ("stream", "true"),
        ("timestamp_granularities[]", "segment"), ("timestamp_granularities[]", "word"),
        ("file", ("audio", b"RIFF-audio"))]
    for bad, media in (({"file": "x"}, [b"a"]), ({"model": {"x": 1}}, [b"a"]), ({"model": "m"}, []),
                       ({'na"me': "x"}, [b"a"])):
        with pytest.raises(ApiError) as e:
            parse_openai("transcriptions", json.dumps(bad).encode(), CFG, media=media)
        assert e.value.status == 400, bad
