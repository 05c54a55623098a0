"""vLLM's scale-out routes (render, derender, token-in-token-out generate) are answered by the gateway
itself, as `vllm serve` without --enable-scale-out answers them: vLLM's 403 and error body, word for
word (read from vLLM's own app, built without an engine). No LM serves them (test_lm_routes.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from services.gateway.config import GatewayConfig
from services.gateway.openai_api import OpenAIRoutes
from services.gateway.request import SCALE_OUT_PATHS

pytestmark = pytest.mark.unit


def _routes() -> tuple[web.Application, OpenAIRoutes]:
    routes = OpenAIRoutes(GatewayConfig(lms="lm:1"), orch=None)  # no request reaches the orchestrator here
    app = web.Application()
    routes.add_to(app)
    return app, routes


def test_the_gateway_answers_the_scale_out_routes_itself_with_vllm_serves_403(tiny_model):
    pytest.importorskip("vllm")
    from tests.unit.helpers import vllm_serve_app

    disabled = {r.path: r.endpoint for r in vllm_serve_app(tiny_model).routes
                if getattr(getattr(r, "endpoint", None), "__name__", "") == "disabled_scale_out"}
    assert set(disabled) == set(SCALE_OUT_PATHS), "vLLM's scale-out routes changed"
    app, routes = _routes()

    async def answers(path: str):
        request = make_mocked_request("POST", path, app=app)
        match = await app.router.resolve(request)
        assert match.handler == routes.scale_out, path  # the gateway's own answer, never an LM call
        return await match.handler(request), await disabled[path]()

    for path in SCALE_OUT_PATHS:
        ours, vllms = asyncio.run(answers(path))
        assert ours.status == vllms.status_code == 403, path
        assert json.loads(ours.body) == json.loads(vllms.body), path
