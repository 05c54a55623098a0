"""A service's Prometheus port (``--metrics-host``:``--metrics-port``): ``/metrics``, the whole
registry of the process (every series, vLLM's included), and any other internal page its owner adds
(the gateway's detailed ``/health``).

Who may read it is who may call the service's API port (``peerauth``'s rule, ``require_for``): bound
to loopback (the default) it is plain HTTP, open to this host only (a Prometheus beside the process,
a pod's sidecar, ``epd up``, the benches), as the API port needs no credentials there. Bound to any
other address it needs what the API port needs there, a server certificate and authenticated callers
(or ``--insecure``, with a warning), and then serves HTTPS with the service's certificate
(``--tls-cert``/``--tls-key``), requires a client certificate signed by ``--tls-ca`` where that is
set (mutual TLS), and ``Authorization: Bearer <token>`` where ``--auth-token-file`` is set: what
Prometheus's ``tls_config`` and ``authorization`` send. A scrape without the token is answered 401
before any page is built.

``MetricsPort`` is owned by the service's ``serve``: started once its gRPC API is bound, stopped
with it; it runs on the service's event loop (a scrape builds the page there, a few milliseconds).
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from peerauth import SecurityConfig, is_loopback

logger = logging.getLogger(__name__)

Page = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Exposure:
    """How a metrics listener is guarded: ``ssl`` (None: plain HTTP) and ``token`` (empty: none asked)."""

    ssl: ssl.SSLContext | None = None
    token: str = ""

    @classmethod
    def guarded(cls, security: SecurityConfig) -> Exposure:
        """The API port's guard: TLS with the service's certificate (client certificates required with
        ``--tls-ca``) where it has one, and its token where it has one."""
        return cls(server_ssl(security) if security.tls_cert else None, security.token)


def exposure_for(host: str, security: SecurityConfig) -> Exposure:
    """The guard of a metrics listener on ``host``: none on loopback, else the API port's. Refuses
    (ValueError) a non-loopback ``host`` the API port's rule refuses (``SecurityConfig.require_for``);
    services call it before an engine start is spent on a configuration that cannot serve."""
    security.require_for(host, f"the metrics port ({host})")
    return Exposure() if is_loopback(host) else Exposure.guarded(security)


def server_ssl(security: SecurityConfig) -> ssl.SSLContext:
    """A server context presenting ``--tls-cert``; with ``--tls-ca``, a client certificate signed by it
    is required (as the gRPC port's ``require_client_auth``). Files are read now: a rotated certificate
    is picked up at the next start."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        ctx.load_verify_locations(security.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def registry_page(request: web.Request) -> web.Response:
    """Every series of the process's Prometheus registry."""
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _bearer(token: str):
    """Middleware: 401 unless ``Authorization: Bearer <token>`` (constant-time comparison)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return web.Response(status=401, text="this metrics port requires the deployment's auth token\n")
        return await handler(request)

    return check


class MetricsPort:
    """An aiohttp listener on ``host:port`` (port 0 picks a free one) guarded by ``exposure``
    (``exposure_for``), serving ``/metrics`` (``registry_page``) and ``pages`` (path -> GET handler).
    ``reuse_port``: bound with SO_REUSEPORT, beside the other processes of one service that serve this
    port (the gateway's workers)."""

    def __init__(self, host: str, port: int, exposure: Exposure, pages: dict[str, Page] | None = None,
                 reuse_port: bool = False) -> None:
        self.host, self.port, self.exposure, self.reuse_port = host, port, exposure, reuse_port
        self.pages: dict[str, Page] = {"/metrics": registry_page, **(pages or {})}
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Binds and serves; returns the port bound. OSError when the address cannot be bound."""
        app = web.Application(middlewares=[_bearer(self.exposure.token)] if self.exposure.token else [])
        for path, page in self.pages.items():
            app.router.add_get(path, page)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=self.exposure.ssl,
                          reuse_port=self.reuse_port or None).start()
        port = self._runner.addresses[0][1]
        logger.info("metrics on %s://%s:%d/metrics%s", "https" if self.exposure.ssl else "http", self.host, port,
                    " (the auth token required)" if self.exposure.token else "")
        return port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
