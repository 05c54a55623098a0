"""The gateway's --api-key is vLLM's (services.gateway.auth mirrors vLLM 0.32's
``AuthenticationMiddleware`` without importing vLLM): the same values, and for every route the gateway
serves, paths it does not, each method and a table of Authorization headers, the same outcome as vLLM's
own middleware (refused with the same status and bytes, or let through), except the one deliberate
difference: ``/tokenize``, which takes media, is guarded as vLLM guards ``/v1``; and the keys come from the same
places (``--api-key`` over ``VLLM_API_KEY``), read through ``vllm serve``'s own argument parser."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from services.cli import build_parser
from services.common.config import from_args
from services.gateway import auth
from services.gateway.config import GatewayConfig
from services.gateway.openai_api import OpenAIRoutes
from services.gateway.tenants import Tenants

pytestmark = pytest.mark.unit

authenticate = pytest.importorskip("vllm.entrypoints.serve.middleware.authenticate")

KEYS = ["good-key", "other-key"]
PATHS = [
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/v1/responses/resp_1",
    "/v1/responses/resp_1/cancel", "/v1/messages", "/v1/messages/count_tokens", "/v1/audio/transcriptions",
    "/v1/chat/completions/render", "/inference/v1/generate", "/inference/v1/abort_requests",
    "/tokenize", "/detokenize", "/version", "/ping", "/health", "/metrics",
    # not served by the gateway: what vLLM's rule says about them still holds (401 or 404)
    "/v1/nope", "/v1", "/v10/x", "/v2/models", "/cohere/v1/chat", "/invocations", "/docs", "/", "/healthz",
]
METHODS = ["GET", "POST", "OPTIONS", "HEAD", "DELETE"]
HEADERS = [None, "", "Bearer good-key", "bearer other-key", "BEARER good-key", "Bearer bad-key", "Basic good-key",
           "Bearergood-key", "Bearer  good-key", "Bearer good-key ", "good-key", "Bearer"]


def test_the_guarded_prefixes_are_vllms():
    assert auth.GUARDED_PREFIXES == authenticate.GUARDED_PREFIX


async def _vllm(method: str, path: str, header: str | None) -> tuple[int, bytes] | None:
    """vLLM's middleware on one request: (status, body) of its refusal, or None when it let it through."""
    passed = []

    async def app(scope, receive, send):
        passed.append(True)

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    headers = [] if header is None else [(b"authorization", header.encode("latin-1"))]
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers,
             "query_string": b""}
    await authenticate.AuthenticationMiddleware(app, tokens=KEYS)(scope, receive, send)
    if passed:
        return None
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _app() -> web.Application:
    """The gateway's routes, as ``server.serve`` registers them (the handlers never run here)."""
    app = web.Application()
    OpenAIRoutes(GatewayConfig(lms="lm:1"), orch=None).add_to(app)
    app.router.add_get("/metrics", lambda request: web.Response())
    return app


async def _ours(app: web.Application, tenants: Tenants, method: str, path: str,
                header: str | None) -> tuple[int, bytes] | None:
    """The gateway's rule on one request, for the route aiohttp resolves it to (what the middleware
    reads off the request): (status, body) of its refusal, or None when it lets it through."""
    match = await app.router.resolve(make_mocked_request(method, path, app=app))
    route = match.route.resource.canonical if match.route.resource is not None else ""
    if auth.rest_tenant(tenants, method, path, route, header) is not None:
        return None
    response = auth.unauthorized()
    return response.status, response.body


GUARDED_HERE = {"/tokenize"}
"""Open on vllm serve, guarded by the gateway (a route that takes media): a POST to it is answered as
vLLM's middleware answers one on a guarded path (another method reaches no route: 405, unguarded)."""


def test_every_route_method_and_header_gets_vllms_answer():
    async def main():
        app, tenants = _app(), Tenants(KEYS)
        refused = 0
        for path in PATHS:
            for method in METHODS:
                for header in HEADERS:
                    guarded_here = path in GUARDED_HERE and method == "POST"
                    want = await _vllm(method, "/v1/models" if guarded_here else path, header)
                    got = await _ours(app, tenants, method, path, header)
                    assert got == want, (method, path, header)
                    refused += want is not None
        assert refused  # the table does exercise refusals

    asyncio.run(main())


def test_the_only_route_vllm_leaves_open_that_the_gateway_guards_is_the_one_that_takes_media():
    async def main():
        app, tenants = _app(), Tenants(KEYS)
        differ = set()
        for path in PATHS:
            for method in METHODS:
                if await _vllm(method, path, None) != await _ours(app, tenants, method, path, None):
                    differ.add(path)
                    assert await _vllm(method, path, None) is None  # the gateway only ever refuses more
        assert differ == GUARDED_HERE
        assert GUARDED_HERE <= auth.MEDIA_ROUTES
        assert await _ours(app, Tenants(), "POST", "/tokenize", None) is None  # without keys: open

    asyncio.run(main())


def test_the_refusal_is_vllms_json_byte_for_byte():
    async def main():
        status, body = await _vllm("POST", "/v1/chat/completions", None)
        assert (status, body) == (auth.UNAUTHORIZED_STATUS, auth.UNAUTHORIZED_BODY)
        assert json.loads(body) == {"error": "Unauthorized"}
        assert auth.unauthorized().content_type == "application/json"

    asyncio.run(main())


@pytest.mark.parametrize("flag,env", [
    (None, None), (None, "env-key"), (["a"], None), (["a", "b,c"], "env-key"), (None, ""),
])
def test_keys_come_from_where_vllm_serve_takes_them(monkeypatch, flag, env):
    from fastapi import FastAPI
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if env is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env)
    argv = ["--api-key", *flag] if flag else []
    app = FastAPI()
    init_entrypoints_middleware(make_arg_parser(FlexibleArgumentParser()).parse_args(argv), app, ())
    vllm_tokens = next((m.kwargs["tokens"] for m in app.user_middleware
                        if m.cls is authenticate.AuthenticationMiddleware), [])

    cfg = from_args(GatewayConfig, build_parser().parse_args(["gateway", "--lms", "lm:1", *argv]))
    tenants = Tenants.from_config(cfg)
    assert tenants.required == bool(vllm_tokens)
    for key in ["a", "b,c", "b", "c", "env-key", ""]:  # let through on a guarded path, or not
        assert (tenants.identify(f"Bearer {key}") is not None) == (key in vllm_tokens or not vllm_tokens), key
