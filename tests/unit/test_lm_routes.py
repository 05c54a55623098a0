"""The routes of vLLM's app the LM answers, and the body type each takes (services/lm/vllm_app.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.routes import APIS, PATH_PARAM
from services.gateway.request import SCALE_OUT_PATHS

pytestmark = pytest.mark.unit

vllm_app = pytest.importorskip("services.lm.vllm_app")


def test_only_the_listed_routes_are_answered():
    assert vllm_app.allowed("POST", "/v1/audio/transcriptions")
    assert vllm_app.allowed("POST", "/v1/audio/translations")
    assert not vllm_app.allowed("GET", "/v1/audio/transcriptions")
    assert not vllm_app.allowed("POST", "/v1/load_lora_adapter")


def test_an_upload_keeps_its_content_type_and_every_other_body_is_json():
    mp = "multipart/form-data; boundary=abc"
    assert vllm_app.body_type("/v1/audio/transcriptions", mp) == mp
    assert vllm_app.body_type("/v1/responses", "") == "application/json"
    assert vllm_app.body_type("/v1/responses", "application/json; charset=utf-8") == "application/json"
    for path, ctype in (("/v1/responses", mp), ("/v1/audio/translations", ""),
                        ("/v1/audio/translations", mp + "\r\nX-Evil: 1"), ("/v1/audio/translations", "é")):
        with pytest.raises(vllm_app.BadInput):
            vllm_app.body_type(path, ctype)


def test_the_allow_list_names_exactly_the_routes_the_lm_serves():
    assert PATH_PARAM == r"[A-Za-z0-9_.-]{1,200}"
    assert [(m, p.pattern) for m, p in vllm_app.ROUTES] == [
        ("POST", r"/v1/responses"),
        ("GET", r"/v1/responses/[A-Za-z0-9_.-]{1,200}"),
        ("POST", r"/v1/responses/[A-Za-z0-9_.-]{1,200}/cancel"),
        ("POST", r"/v1/messages"),
        ("POST", r"/v1/messages/count_tokens"),
        ("POST", r"/tokenize"),
        ("POST", r"/detokenize"),
        ("GET", r"/version"),
        ("POST", r"/v1/audio/transcriptions"),
        ("POST", r"/v1/audio/translations"),
    ]


def _gateway_http_routes() -> list[tuple[str, str]]:
    """What the gateway sends to the LM's copy of vLLM's app (a stored response named resp_1)."""
    return [(a.method, a.path.replace("{response_id}", "resp_1")) for a in APIS if a.lm_api == "http"]


def test_the_lm_serves_every_route_the_gateway_forwards_and_nothing_else():
    forwarded = _gateway_http_routes()
    for method, path in forwarded:
        assert vllm_app.allowed(method, path), (method, path)
    for method, pattern in vllm_app.ROUTES:
        assert any(m == method and pattern.fullmatch(p) for m, p in forwarded), (method, pattern.pattern)


@pytest.mark.parametrize("path", SCALE_OUT_PATHS)
def test_the_scale_out_routes_are_refused_by_the_lm_itself_before_vllms_app(path):
    assert not vllm_app.allowed("POST", path)

    async def first():
        # No app at all: the refusal must come before vLLM's app would be called.
        return await anext(vllm_app.call(None, "POST", path, b"{}", "application/json"))

    with pytest.raises(vllm_app.BadInput, match="does not answer"):
        asyncio.run(first())
