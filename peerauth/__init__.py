"""Who may talk to whom: TLS and a shared token on every epd-serve gRPC link.

The deployment's security floor, below both the transfer library (``ectransfer``: its Transfer
server and client) and the services (their API ports, the gateway's channels): it imports
neither, and nothing in it knows what travels over the links it protects.

One ``SecurityConfig`` per process, the same four options on every service
(``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--auth-token-file``). It covers
every internal link: gateway -> encoder and gateway -> LM (API ports), LM ->
encoder (the Transfer port, from the LM service's handshake and from the
LM engine's transfer client) and the encoder service -> its own engine's
Transfer port. The same-host control lane is proven by a per-session secret
that travels inside the (TLS-protected, token-checked) Transfer stream.

- **TLS** (``tls_cert`` + ``tls_key``): servers present the certificate.
  With ``tls_ca`` as well it is *mutual* TLS: servers require a client
  certificate signed by that CA, and clients present theirs and verify the
  server's against it. A client with only ``tls_ca`` verifies servers and
  presents nothing (useful for a client that only calls, like ``epd up``'s
  readiness check); a server needs a cert and key.
- **Token** (``auth_token_file``): every call carries ``authorization:
  Bearer <token>``; servers refuse a missing or wrong one with
  UNAUTHENTICATED (``TokenInterceptor``). Over TLS the token is sent as
  grpcio call credentials; without TLS (a cluster whose mesh terminates TLS)
  a client interceptor adds the same header. Health checks are exempt (they
  reveal only SERVING or not, and Kubernetes probes carry no token).
  Refusals are counted by reason and logged at a bounded rate
  (``peerauth.refusals``): anyone who reaches a port can make it refuse.
- Neither set: plain gRPC, as for one host on loopback.

What a server may bind (``require_for``): loopback, anything. Any other
address needs a server certificate (``tls_cert`` + ``tls_key``) *and*
authenticated callers (the token or client certificates): with the token
alone the token and the embeddings would cross the network in clear, and
anyone on the path could replay the one or read the other. ``insecure``
(``--insecure``) says the network itself is trusted (a mesh that terminates
TLS between the pods, or one host): then a non-loopback bind without TLS, or
without authentication, is allowed with a warning.

Everything here is grpcio's own TLS and call credentials; nothing is a
hand-made scheme. Certificate files are read whenever a channel or port is
made (so a rotated certificate is picked up by new channels); the token once.
``to_dict``/``from_dict`` carry the config into vLLM's engine process (through
the connector's extra config), where the Transfer server and client run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from peerauth.refusals import REFUSALS

logger = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
# Calls that anyone may make: liveness/readiness only.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass
class SecurityConfig:
    tls_cert: str = ""
    """PEM certificate chain this process presents: as a server always, as a client too when --tls-ca is set
    (mutual TLS). Needs --tls-key."""
    tls_key: str = ""
    """PEM private key of --tls-cert."""
    tls_ca: str = ""
    """PEM CA bundle: clients verify servers against it; servers with it require client certificates signed
    by it (mutual TLS)."""
    tls_server_name: str = ""
    """Name clients check in a server's certificate instead of the host they dial (for certificates issued to
    one service name while peers are dialled by address)."""
    auth_token_file: str = ""
    """File holding a shared secret; every internal gRPC call must carry it (health checks excepted). Use it
    with TLS (--tls-cert/--tls-key) on any non-loopback address; alone only with --insecure, where a mesh
    already encrypts the links or everything runs on one host."""
    reflection: bool = False
    """Serve gRPC server reflection (lists every service and message to anyone who connects)."""
    insecure: bool = False
    """Allow serving a non-loopback address without TLS (the token alone) or without authentication at all,
    with a warning: only where the network is trusted (a mesh that terminates TLS, or one host)."""
    _token: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together (got one without the other)")
        for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
            path = getattr(self, name)
            if path:
                try:
                    open(path, "rb").close()
                except OSError as e:
                    raise ValueError(f"--{name.replace('_', '-')} {path!r}: {e.strerror}") from None
        if self.auth_token_file and not self.token:
            raise ValueError(f"--auth-token-file {self.auth_token_file!r} is empty")

    # -- what is on -----------------------------------------------------------

    @property
    def tls(self) -> bool:
        """Clients use TLS (they have a CA to verify servers, or present a certificate)."""
        return bool(self.tls_ca or self.tls_cert)

    @property
    def token(self) -> str:
        if self._token is None:
            self._token = _read(self.auth_token_file).decode().strip() if self.auth_token_file else ""
        return self._token

    @property
    def authenticated(self) -> bool:
        """Callers of our servers prove who they are (a client certificate or the token)."""
        return bool(self.token or (self.tls_cert and self.tls_ca))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SecurityConfig:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})

    def require_for(self, host: str, what: str) -> None:
        """Refuses (ValueError) to serve ``what`` on a ``host`` that other
        machines can reach unless both its callers authenticate (token or
        client certificates) and the server speaks TLS (``tls_cert`` and
        ``tls_key``), so that neither the token nor what the callers fetch
        crosses the network in clear. ``insecure`` turns the refusal into a
        warning. Loopback needs neither. Called by every server before it
        binds (and by ``check`` before an engine starts)."""
        if is_loopback(host):
            return
        missing = []
        if not self.authenticated:
            missing.append("without authentication: anyone who can reach it could call it; set --auth-token-file "
                           "or client certificates (--tls-cert/--tls-key/--tls-ca)")
        if not self.tls_cert:
            missing.append("without TLS: the auth token and the embeddings would cross the network in clear; "
                           "set --tls-cert/--tls-key")
        if not missing:
            return
        msg = f"{what} would listen on {host} " + "; and ".join(missing)
        if not self.insecure:
            raise ValueError(msg + " (or --insecure where the network is trusted: a mesh that terminates TLS, "
                                   "or one host)")
        logger.warning("%s (allowed by --insecure)", msg)

    # -- servers ---------------------------------------------------------------

    def server_interceptors(self) -> list:
        return [TokenInterceptor(self.token)] if self.token else []

    def add_port(self, server, address: str) -> int:
        """Binds ``address`` on ``server`` (grpc.aio), with TLS when configured.
        A server needs its own certificate for TLS: with only ``tls_ca`` its
        clients would speak TLS to a plaintext port, so that is refused."""
        if self.tls_ca and not self.tls_cert:
            raise ValueError("a server with --tls-ca needs --tls-cert and --tls-key too (its peers speak TLS)")
        if not self.tls_cert:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            require_client_auth=bool(self.tls_ca))
        return server.add_secure_port(address, creds)

    # -- clients ---------------------------------------------------------------

    def _channel_credentials(self):
        mine = (_read(self.tls_key), _read(self.tls_cert)) if (self.tls_cert and self.tls_ca) else (None, None)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            private_key=mine[0], certificate_chain=mine[1])
        if self.token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.token))
        return creds

    def _options(self, options) -> list:
        opts = list(options or [])
        if self.tls and self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return opts

    def aio_channel(self, target: str, options=None) -> grpc.aio.Channel:
        """A grpc.aio channel to ``target`` that proves who we are."""
        if self.tls:
            return grpc.aio.secure_channel(target, self._channel_credentials(), options=self._options(options))
        interceptors = _aio_token_interceptors(self.token) if self.token else None
        return grpc.aio.insecure_channel(target, options=self._options(options), interceptors=interceptors)

    def channel(self, target: str, options=None) -> grpc.Channel:
        """A blocking-API channel (readiness checks, tests, tools)."""
        if self.tls:
            return grpc.secure_channel(target, self._channel_credentials(), options=self._options(options))
        ch = grpc.insecure_channel(target, options=self._options(options))
        if self.token:
            ch = grpc.intercept_channel(ch, _SyncTokenClientInterceptor(self.token))
        return ch


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's loopback:
    "localhost" or a loopback address. Any other name counts as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- the token: server side ---------------------------------------------------------


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (health excepted) without ``authorization: Bearer
    <token>``, before its handler runs: nothing is read, reserved or cancelled
    for an unauthenticated peer. The comparison is constant-time.

    It runs on the call's headers, before any request message is read: a
    refused call with a single request message (Encode, Generate, GetInfo,
    Stats) gets a handler that never reads it, so grpc buffers at most its
    flow-control window of it, not the message. A refused streaming call
    (Transfer) reads its first message, so that the caller gets the status
    rather than a reset while it writes: that message is bounded by the
    port's receive limit (1 MiB on a Transfer port: consumers send only
    control messages)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _refusal_reason(self, details) -> str:
        """Why the call is refused (a ``refusals.REASONS`` key); "" when it may go on."""
        if details.method.startswith(EXEMPT_PREFIXES):
            return ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else value
                return "" if hmac.compare_digest(got, self._expected) else "wrong_token"
        return "no_token"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        reason = "" if handler is None else self._refusal_reason(details)
        if not reason:
            return handler
        REFUSALS.refused(reason, details.method)  # counted; logged at a bounded rate
        return _refusal(handler)


_REFUSAL = "this service requires authentication (a valid auth token)"


async def _first_request(request_iterator) -> None:
    """Waits (briefly) for a streaming caller's first message: a status sent
    while it still writes reaches it as INTERNAL instead of the reason."""
    try:
        async with asyncio.timeout(5.0):
            await anext(aiter(request_iterator), None)
    except (TimeoutError, grpc.RpcError):
        pass


def _refusal(handler):
    """A handler that refuses the call. For a single-request method it is a request-streaming
    handler that never reads: grpc then never buffers the (possibly large) request message."""

    async def unread(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def unread_streaming(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    async def stream_in(request_iterator, context):
        await _first_request(request_iterator)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def stream_in_out(request_iterator, context):
        await _first_request(request_iterator)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_in_out, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream_in, **kw)
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(unread_streaming, **kw)
    return grpc.stream_unary_rpc_method_handler(unread, **kw)


# -- the token: client side without TLS ------------------------------------------------


def _details(details, metadata):
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AioToken:
    def __init__(self, token: str) -> None:
        self.token = token

    def _d(self, details):
        return _details(details, [*(details.metadata or ()), (AUTH_HEADER, f"Bearer {self.token}")])


# grpc.aio files each interceptor under the first call kind it implements, so
# one class per kind.
class _AioTokenUU(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._d(details), request)


class _AioTokenUS(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._d(details), request)


class _AioTokenSU(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._d(details), request_iterator)


class _AioTokenSS(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._d(details), request_iterator)


def _aio_token_interceptors(token: str) -> list:
    """Add the token to every call on an insecure grpc.aio channel (grpcio
    refuses call credentials without TLS)."""
    return [cls(token) for cls in (_AioTokenUU, _AioTokenUS, _AioTokenSU, _AioTokenSS)]


class _SyncDetails:
    def __init__(self, d, metadata) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = getattr(d, "wait_for_ready", None), getattr(d, "compression", None)
        self.metadata = metadata


class _SyncTokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    def _d(self, details):
        return _SyncDetails(details, [*(details.metadata or ()), (AUTH_HEADER, f"Bearer {self.token}")])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._d(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._d(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._d(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._d(details), request_iterator)
