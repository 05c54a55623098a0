"""The one route table (services/common/routes.py): the gateway's endpoints and the LM's copy of vLLM's
app are two views of it, so every route the gateway forwards to vLLM's app is one the LM answers, and
the LM answers no other. Needs no vLLM: the table is the gateway's too."""

from __future__ import annotations

import pytest

from services.common.routes import API, APIS, lm_app_routes, path_pattern

pytestmark = pytest.mark.unit


def _sent(path: str) -> str:
    """A path as the gateway forwards it (a stored response named ``resp_1``)."""
    return path.replace("{response_id}", "resp_1")


def test_each_endpoint_the_gateway_forwards_to_vllms_app_is_one_route_of_the_lm_and_no_other():
    lm = lm_app_routes()
    forwarded = [a for a in APIS if a.lm_api == "http"]
    assert len(lm) == len(forwarded)
    for api in forwarded:
        hits = [(m, p, up) for m, p, up in lm if p.fullmatch(_sent(api.path))]
        assert [(m, up) for m, _, up in hits] == [(api.method, api.upload)], api.name


def test_chat_and_completions_are_not_routes_of_vllms_app():
    for name in ("chat", "completions"):
        assert not any(p.fullmatch(API[name].path) for _, p, _ in lm_app_routes()), name


def test_a_path_parameter_is_one_bounded_segment_of_url_safe_characters():
    get = path_pattern(API["responses_get"].path)
    assert get.fullmatch("/v1/responses/resp_0123.ab-C")
    assert get.fullmatch("/v1/responses/" + "a" * 200)
    for bad in ("/v1/responses/" + "a" * 201, "/v1/responses/", "/v1/responses/a/b", "/v1/responses/a%2Fb",
                "/v1/responses/a/cancel"):
        assert not get.fullmatch(bad), bad
    assert path_pattern(API["responses_cancel"].path).fullmatch("/v1/responses/resp_1/cancel")


def test_literal_parts_of_a_path_match_only_themselves():
    assert not path_pattern("/v1/messages/count_tokens").fullmatch("/v1/messages/countXtokens")
    assert not path_pattern("/version").fullmatch("/versions")


def test_the_uploads_are_the_audio_routes():
    assert [a.name for a in APIS if a.upload] == ["transcriptions", "translations"]
    assert [p.pattern for _, p, up in lm_app_routes() if up] == ["/v1/audio/transcriptions", "/v1/audio/translations"]
