"""Client authentication on the gateway's public ports: ``vllm serve``'s rule for ``--api-key``, with
the keys and tenants of ``services.gateway.tenants``.

REST (``middleware``), as vLLM's ``AuthenticationMiddleware``
(``vllm/entrypoints/serve/middleware/authenticate.py``): a request whose path starts with one of
``GUARDED_PREFIXES``, by any method but OPTIONS, must carry ``Authorization: Bearer <key>`` (the
scheme in any case) with a key the gateway knows; otherwise it is answered 401 with vLLM's body,
``UNAUTHORIZED_BODY``, before its body is read. One deliberate difference: a route whose body may
carry media (``MEDIA_ROUTES``: ``/tokenize``, whose images and audio the gateway fetches, decodes and
hands to the LM's processor) is guarded too, wherever its path is, while vLLM leaves ``/tokenize``
open; with keys, media work is for key holders only. Every other path (``/health``, ``/ping``,
``/metrics``, ``/detokenize``, ``/version``) is open, as on ``vllm serve``. A request to a route
under a guarded prefix is guarded whatever its path was spelled as. The gateway does not import
vLLM: ``tests/unit/test_auth_vllm.py`` checks these values, and the rule, against vLLM's own
middleware.

gRPC (``GrpcAuth``): every ``GatewayService`` call needs the same key in its ``authorization``
metadata (``Bearer <key>``); a call without one ends UNAUTHENTICATED before its request message is
read and before the intake takes anything for it: ``GrpcAuth`` is the first interceptor, and a
refused call gets a handler that never reads. Health (and reflection, when on) stay open, as
``/health`` does.

Either way the request's tenant name is ``CURRENT_TENANT`` for the rest of its path, and
``request[TENANT_KEY]`` on REST. A request to an open route is the tenant its key names, or
``anonymous``. Refusals are counted (``epd_gateway_unauthenticated_total``), not logged: a log line
per refusal would let anyone fill the log.
"""

from __future__ import annotations

import contextvars
import inspect

import grpc
from aiohttp import web
from prometheus_client import Counter

from services.common.routes import APIS
from services.gateway.tenants import ANONYMOUS, Tenants

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""vLLM's ``GUARDED_PREFIX``: the paths ``--api-key`` guards (by ``str.startswith``)."""
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
"""vLLM's refusal, byte for byte (Starlette's ``JSONResponse({"error": "Unauthorized"})``)."""
EXEMPT_METHOD = "OPTIONS"
"""The method vLLM never guards (CORS preflights)."""
REFUSAL = "Unauthorized"
"""The gRPC API's UNAUTHENTICATED details (REST's word)."""
TENANT_KEY = web.RequestKey("epd_tenant", str)
"""The aiohttp request's key for its tenant's name."""

CURRENT_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("epd_tenant", default=ANONYMOUS)
"""The name of the tenant whose request the current task serves (set by ``middleware`` and
``GrpcAuth``; ``anonymous`` where nobody set it)."""

REFUSED = Counter("epd_gateway_unauthenticated_total", "Requests refused for a missing or unknown API key",
                  ["api"])


MEDIA_ROUTES = frozenset(a.path for a in APIS if a.media or a.upload)
"""The routes whose bodies may carry media: guarded wherever their path is (the module docstring)."""


def guarded(method: str, path: str, route: str = "") -> bool:
    """Whether a REST request needs a key: its ``path`` is under a guarded prefix (vLLM's test), or
    the ``route`` it reached is (the route's canonical path: the same route by another spelling), or
    that route takes media, unless its method is OPTIONS."""
    return method != EXEMPT_METHOD and (path.startswith(GUARDED_PREFIXES) or route.startswith(GUARDED_PREFIXES)
                                        or route in MEDIA_ROUTES)


def rest_tenant(tenants: Tenants, method: str, path: str, route: str, authorization: str | None) -> str | None:
    """The tenant name of a REST request (``authorization``: its ``Authorization`` header). None:
    it is refused (401). An open route's request without a known key is ``anonymous``."""
    tenant = tenants.identify(authorization)
    if tenant is not None:
        return tenant.name
    return None if guarded(method, path, route) else ANONYMOUS


def unauthorized() -> web.Response:
    """vLLM's refusal."""
    return web.Response(status=UNAUTHORIZED_STATUS, body=UNAUTHORIZED_BODY, content_type="application/json")


def middleware(tenants: Tenants):
    """The REST API's authentication (the app's first middleware): 401 for a guarded request
    without a known key; otherwise the request's tenant is set and it goes on."""

    @web.middleware
    async def authenticate(request: web.Request, handler):
        resource = request.match_info.route.resource  # None for a path no route serves (404, 405)
        name = rest_tenant(tenants, request.method, request.path, resource.canonical if resource else "",
                           request.headers.get("Authorization"))
        if name is None:
            REFUSED.labels("rest").inc()
            return unauthorized()
        request[TENANT_KEY] = name
        CURRENT_TENANT.set(name)
        return await handler(request)

    return authenticate


class GrpcAuth(grpc.aio.ServerInterceptor):
    """The gRPC API's authentication (the server's first interceptor; see the module docstring)."""

    SERVICE = "/epd.gateway.v1.GatewayService/"
    METADATA = "authorization"

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    async def intercept_service(self, continuation, details):
        # The continuation only builds the inner interceptors' handlers: nothing is read or taken
        # until a handler runs.
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.SERVICE):
            return handler
        value = next((v for k, v in details.invocation_metadata or () if k == self.METADATA), None)
        tenant = self.tenants.identify(value if isinstance(value, str) else None)
        if tenant is None:
            REFUSED.labels("grpc").inc()
            return _refusal(handler)
        return handler if tenant.name == ANONYMOUS else _as_tenant(handler, tenant.name)


def _refusal(handler):
    """A handler that ends the call UNAUTHENTICATED without reading its request: request-streaming
    whatever the method's shape, so grpc never receives a single request message for it either."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def refuse_streaming(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    async def refuse(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_streaming, **kw)
    return grpc.stream_unary_rpc_method_handler(refuse, **kw)


def _as_tenant(handler, name: str):
    """``handler`` with ``CURRENT_TENANT`` set to ``name`` first (in the call's own task, so it
    holds for the whole call and for that call only)."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        if inspect.isasyncgenfunction(inner):
            async def streaming(request, context):
                CURRENT_TENANT.set(name)
                async for response in inner(request, context):
                    yield response
        else:  # a handler that writes its answers itself (GrpcIntake's)
            async def streaming(request, context):
                CURRENT_TENANT.set(name)
                await inner(request, context)

        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming else \
            grpc.unary_stream_rpc_method_handler
        return make(streaming, **kw)
    inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request, context):
        CURRENT_TENANT.set(name)
        return await inner(request, context)

    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make(unary, **kw)
