"""The routes of vLLM's app the LM answers, and the body type each takes (services/lm/vllm_app.py)."""

from __future__ import annotations

import pytest

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
