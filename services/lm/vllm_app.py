"""vLLM's own HTTP application inside the LM, called in-process: every route of `vllm serve` that the
LM answers (Responses, Anthropic Messages, tokenize and detokenize, version, the audio
transcriptions and translations of an encoder-decoder model) is answered
by the code `vllm serve` runs, over the LM's ``ConsumerEngine`` (so its renderer is the
``LaidOutRenderer`` and its engine calls carry the gateway's ``ec_transfer_params``, as for chat).

``build_vllm_app`` makes the app as ``vllm serve`` does (``build_app`` + ``init_app_state``, with
``vllm serve``'s own parsed arguments; its speech-to-text servings then set up by
``services.lm.speech.guard_servings``); ``call`` runs one request through it as ASGI, with no socket:
the request's body goes in, the response's status, content type and body chunks come out as they
are produced. The caller (``LMServicer.Generate``) owns the call: closing the generator ``call``
returns cancels vLLM's handler, which aborts the engine request as a client hanging up on
`vllm serve` does.

Only ``ROUTES`` are answered: the part of the gateway's public surface that vLLM's app serves, read from
the one route table the gateway reads too (``services.common.routes``).
Everything else vLLM's app has (LoRA loading, sleep and wake, elastic scaling, the scale-out render and
token routes, metrics) is refused here (``BadInput``) before vLLM's app sees it, whatever the gateway
sends.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app

from services.common.errors import BadInput
from services.common.routes import lm_app_routes
from services.lm.speech import guard_servings

ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((method, pattern) for method, pattern, _ in lm_app_routes())
"""The routes of vLLM's app the LM serves (method, full-match path): the endpoints of the one route table
(``services.common.routes``) that the gateway forwards to vLLM's app; each one runs its handler over the
LM's engine. Nothing is listed for vLLM to refuse (the scale-out routes' 403 is the gateway's own answer,
``services.gateway.request.SCALE_OUT_PATHS``): a route here is one more way into the engine."""

MAX_RESPONSE_BYTES = 64 << 20
"""A non-streaming answer larger than this is refused (it would be one gRPC message)."""


UPLOADS: tuple[re.Pattern[str], ...] = tuple(pattern for _, pattern, upload in lm_app_routes() if upload)
"""The routes whose body is an upload (``multipart/form-data``); every other route's is JSON."""


def allowed(method: str, path: str) -> bool:
    return any(m == method and p.fullmatch(path) for m, p in ROUTES)


def body_type(path: str, content_type: str) -> str:
    """The Content-Type the LM hands vLLM's app for a body sent to ``path`` as ``content_type``: JSON for
    every route but the audio uploads, whose own (``multipart/form-data; boundary=...``, as the client
    sent it) goes with them: vLLM's app parses the upload, and answers one it cannot read as `vllm
    serve` does. Raises BadInput for a JSON route given another type, or a header that is not one line
    of printable ASCII."""
    if any(p.fullmatch(path) for p in UPLOADS):
        if not content_type or len(content_type) > 256 or not content_type.isascii() or \
                not content_type.isprintable():
            raise BadInput(f"{path}: the upload's Content-Type must be one line of printable ASCII")
        return content_type
    if content_type.split(";", 1)[0].strip().lower() not in ("", "application/json"):
        raise BadInput(f"{path} takes a JSON body, not {content_type[:80]!r}")
    return "application/json"


@dataclass
class Started:
    """The first thing ``call`` yields: the response's status and content type."""

    status: int
    content_type: str


async def build_vllm_app(engine_client, args):
    """vLLM's FastAPI app for ``args`` (``vllm serve``'s parsed flags) over ``engine_client``, with its
    state initialised as ``vllm serve`` initialises it."""
    # vLLM's app bootstraps SageMaker's hosting standards, whose logging_config sets the root logger
    # and its handlers to ERROR when it is imported (its LOG_LEVEL default) and again at bootstrap:
    # every log line of the LM service below ERROR would vanish. The root logger is the service's;
    # its levels are put back once the app is built.
    root = logging.getLogger()
    levels = (root.level, [(h, h.level) for h in root.handlers])
    try:
        tasks = await engine_client.get_supported_tasks()
        app = build_app(args, tasks, engine_client.model_config)
        await init_app_state(engine_client, app.state, args, tasks)
        guard_servings(app.state)  # speech uploads: decodes charged, windows named per tenant
    finally:
        root.setLevel(levels[0])
        for handler, level in levels[1]:
            handler.setLevel(level)
    return app


async def call(app, method: str, path: str, body: bytes, content_type: str = "") -> AsyncIterator[Started | bytes]:
    """One request through ``app``: yields ``Started`` once, then the body's chunks (one for a plain
    response, one per write for a stream). Raises BadInput for a route the LM does not answer, or a
    body of another type than the route takes (``body_type``)."""
    if not allowed(method, path):
        raise BadInput(f"the LM does not answer {method} {path[:80]}")
    content_type = body_type(path, content_type)
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"host", b"lm"), (b"content-type", content_type.encode("latin-1")),
                    (b"content-length", str(len(body)).encode())],
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # a streaming response listens for the client leaving: only when we stop
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        started = False
        size = 0
        while True:
            message = await out.get()
            if message is None:
                task.result()  # the app's own exception, if it raised one
                if not started:
                    raise RuntimeError(f"vLLM's app sent no response to {method} {path}")
                return
            if message["type"] == "http.response.start":
                headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
                started = True
                yield Started(message["status"], headers.get("content-type", ""))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise BadInput(f"the answer to {method} {path} is larger than {MAX_RESPONSE_BYTES >> 20} MiB")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    await task
                    return
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the caller went away; nothing to report
                pass
