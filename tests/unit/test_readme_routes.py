"""README's endpoint table names every route `vllm serve` registers for a generative multimodal model
or a speech-to-text one
(vLLM's own app, built as `vllm serve` builds it, without an engine), and every route the gateway
serves is one of them or its own."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.unit

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _vllm_routes(model: str) -> set[tuple[str, str]]:
    from tests.unit.helpers import vllm_serve_app

    app = vllm_serve_app(model)
    return {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or {"GET"}) if m != "HEAD"}


def _readme_table() -> str:
    with open(README) as f:
        text = f.read()
    return text[text.index("| route (`vllm serve`) | epd-serve |"):text.index("Send `\"return_token_ids\"")]


def test_every_route_vllm_serve_registers_is_in_the_readme(tiny_model):
    pytest.importorskip("vllm")
    table = _readme_table()
    named = {(m, p) for cell in re.findall(r"`((?:GET|POST) [^`]+)`", table) for m, p in [cell.split(" ", 1)]}
    routes = _vllm_routes(tiny_model)
    assert len(routes) > 30
    missing = sorted(routes - named)
    assert not missing, f"README's endpoint table lacks {missing}"


def test_every_route_the_gateway_serves_is_vllms_or_its_own(tiny_model):
    pytest.importorskip("vllm")
    from services.common.routes import APIS
    from services.gateway.request import SCALE_OUT_PATHS

    routes = _vllm_routes(tiny_model)
    for api in APIS:
        assert (api.method, api.path.replace("{response_id}", "{response_id}")) in routes, api
    for path in SCALE_OUT_PATHS:  # the ones it answers itself, as vLLM does
        assert ("POST", path) in routes, path
