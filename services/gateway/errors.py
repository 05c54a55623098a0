"""The gateway's errors, in one place: ``ApiError`` (what a client is answered before, or instead of,
an LM's answer), the HTTP <-> gRPC status table both front ends use (``STATUS``), a deployment's gRPC
error as a client's (``from_grpc``), and the error bodies vLLM's server writes (``error_body``).
Which peer failed, and whether a retry helps, is ``failures``'; this is what the client sees."""

from __future__ import annotations

from typing import Any

import grpc

from services.common.errors import MediaError
from services.gateway.intake import BodyRefused


class ApiError(Exception):
    """A request answered with an error before (or instead of) an LM's answer: an HTTP status, the
    message, the OpenAI error type and param, and ``retry_after`` (the header's seconds) where coming
    back later helps. The gRPC API answers it with ``grpc_code(status)``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 retry_after: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.retry_after = status, message, type_, param, retry_after

    def __reduce__(self):
        """Pickled whole (the parse pool's helper raises it in another process): an Exception pickles only
        its ``args``, here the message alone, which this ``__init__`` could not take back."""
        return type(self), (self.status, self.message, self.type, self.param, self.retry_after)


def media_api_error(e: MediaError) -> ApiError:
    """A refused media item as the REST API answers it: 400 or 413, param image_url (audio_url)."""
    return ApiError(e.status, str(e), param=f"{e.modality}_url")


_C = grpc.StatusCode
STATUS: tuple[tuple[grpc.StatusCode, int, str, str], ...] = (
    # (gRPC code, HTTP status, OpenAI error type, direction: "both", "to_http" or "to_grpc")
    (_C.INVALID_ARGUMENT, 400, "invalid_request_error", "both"),
    (_C.OUT_OF_RANGE, 400, "invalid_request_error", "to_http"),
    (_C.INVALID_ARGUMENT, 422, "invalid_request_error", "to_grpc"),
    (_C.NOT_FOUND, 404, "not_found_error", "both"),
    (_C.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "both"),
    (_C.RESOURCE_EXHAUSTED, 413, "invalid_request_error", "to_grpc"),
    # The gateway's own credentials or an LM's allow-list, instances that do not agree: a
    # deployment fault, not the client's (502); a 401/403 from an LM's answer keeps its meaning.
    (_C.FAILED_PRECONDITION, 502, "server_error", "to_http"),
    (_C.UNAUTHENTICATED, 502, "server_error", "to_http"),
    (_C.PERMISSION_DENIED, 502, "server_error", "to_http"),
    (_C.UNAUTHENTICATED, 401, "authentication_error", "to_grpc"),
    (_C.PERMISSION_DENIED, 403, "permission_error", "to_grpc"),
    (_C.UNAVAILABLE, 503, "server_error", "both"),
    (_C.DEADLINE_EXCEEDED, 504, "server_error", "both"),
    (_C.CANCELLED, 499, "server_error", "both"),
    (_C.UNIMPLEMENTED, 501, "server_error", "both"),
)
"""HTTP <-> gRPC. A code with no row is HTTP 500 (server_error); a status with no row is INTERNAL."""

TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {}
TO_GRPC: dict[int, grpc.StatusCode] = {}
for _code, _status, _type, _way in STATUS:
    if _way in ("both", "to_http"):
        TO_HTTP.setdefault(_code, (_status, _type))
    if _way in ("both", "to_grpc"):
        TO_GRPC.setdefault(_status, _code)


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return TO_HTTP.get(code, (500, "server_error"))


def grpc_code(status: int) -> grpc.StatusCode:
    return TO_GRPC.get(status, grpc.StatusCode.INTERNAL)


_DEPLOYMENT_FAULTS = {
    grpc.StatusCode.INTERNAL: "internal error",
    grpc.StatusCode.UNAVAILABLE: "no instance could serve the request",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out in the deployment",
    grpc.StatusCode.FAILED_PRECONDITION: "the deployment's instances do not agree",
    grpc.StatusCode.UNAUTHENTICATED: "the deployment's instances refused each other's credentials",
    grpc.StatusCode.PERMISSION_DENIED: "the deployment's instances refused each other's credentials",
}
"""Codes whose details describe the deployment (instance addresses, what failed where), not the request:
without ``--epd-facts`` a caller gets this summary and the request id; the gateway's log has the details."""


def from_grpc(e: grpc.aio.AioRpcError, rid: str = "", facts: bool = True) -> ApiError:
    """A gRPC status from the deployment as the HTTP error a client gets (``STATUS``). ``facts``
    off (``--epd-facts``): a deployment fault's details are replaced by a summary naming the request
    (``rid``)."""
    status, type_ = http_status(e.code())
    summary = _DEPLOYMENT_FAULTS.get(e.code())
    if summary is not None and not facts:
        return ApiError(status, f"{summary} (request {rid or 'unknown'}; the gateway's log has the details)", type_)
    return ApiError(status, e.details() or e.code().name, type_)


def error_body(e: ApiError, anthropic: bool = False) -> dict[str, Any]:
    """An error as vLLM's server writes it: OpenAI's shape, or Anthropic's for the Messages API
    (vLLM's ``translate_error_response``: the type and message only)."""
    if anthropic:
        return {"type": "error", "error": {"type": e.type, "message": e.message}}
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}


def body_refused(e: BodyRefused) -> ApiError:
    """The intake's refusal (body too large, too slow, no room to read it now) as the core's."""
    if e.status == 503:
        return ApiError(503, e.message, "server_error", retry_after="1")
    if e.status == 429:  # a tenant over its share of the body budget
        return ApiError(429, e.message, "rate_limit_error", retry_after="1")
    return ApiError(e.status, e.message)
