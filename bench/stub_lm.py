"""A stub LM service for the gateway benchmark: the real LMService protocol,
no engine.

``Generate`` answers the OpenAI request in ``openai.body`` the way the LM's
vLLM serving classes do, with ``max_completion_tokens`` / ``max_tokens``
(default 16) tokens " tok" and finish_reason "length", as fast as grpc.aio
sends it: a non-streaming request gets one message (http_status 200, the whole
chat.completion / text_completion JSON), a streaming one one server-sent event
per message ("data: {chunk}\n\n": the role chunk, one chunk per token, the
usage chunk when ``stream_options.include_usage``, then "data: [DONE]\n\n");
both end with a message that has no ``openai`` but ``timings``, finish_reason
and usage set. So ``bench/gateway.py`` measures the gateway's own cost and not
vLLM's scheduling noise. vLLM's Responses routes (``openai.api`` "http", as the
gateway forwards them) are answered from a store as far as the gateway reads
them: ``POST /v1/responses`` stores the response under the body's
``request_id`` ("completed" at once, or "queued" when ``"background": true``),
``GET /v1/responses/{id}`` answers its status (a background one is
"in_progress" for ``--background-s``, then "completed"), ``POST
/v1/responses/{id}/cancel`` cancels it; an unknown id is 404. The store keeps
the newest ``STORE_ENTRIES`` responses. A body that is not a JSON object is answered 400 with
an OpenAI error body. ``GetInfo`` answers model "stub-lm". The server is the
services' own ``GrpcServer`` (grpc.health.v1 with "" and the service name
SERVING, reflection, the error interceptor), so the gateway and a direct client
see what they would see from ``epd lm``.

    python bench/stub_lm.py --port 50099
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from services.common.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

MODEL = "stub-lm"
DEFAULT_MAX_TOKENS = 16
TOKEN = " tok"
PROMPT_TOKENS = 16  # a fixed prompt length: the stub does not tokenize, and the gateway does not care
STORE_ENTRIES = 100_000


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                 "code": status}}).encode()


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _usage(n: int) -> dict:
    return {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + n, "completion_tokens": n}


def answer(request_id: str, api: str, body: dict, n: int) -> tuple[bytes, list[bytes]]:
    """vLLM's answer to ``body``: (the whole JSON, []) or (b"", the SSE events) when it streams."""
    chat = api == "chat"
    created = int(time.time())
    head = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": body.get("model") or MODEL}
    if body.get("stream") is not True:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": TOKEN * n, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": TOKEN * n, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None}
        return json.dumps({**head, "choices": [choice], "usage": _usage(n)}).encode(), []
    if chat:
        head["object"] = "chat.completion.chunk"
        def choice(delta, finish=None):
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        events = [_event({**head, "choices": [choice({"role": "assistant", "content": ""})]})]
        token = choice({"content": TOKEN})
        last = choice({"content": TOKEN}, "length")
    else:
        def token_choice(finish=None):
            return {"index": 0, "text": TOKEN, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        events, token, last = [], token_choice(), token_choice("length")
    # The n - 1 chunks before the last are the same bytes: serialized once.
    events += [_event({**head, "choices": [token]})] * (n - 1) + [_event({**head, "choices": [last]})]
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        events.append(_event({**head, "choices": [], "usage": _usage(n)}))
    events.append(b"data: [DONE]\n\n")
    return b"", events


class ResponseStore:
    """vLLM's Responses store, as far as the gateway reads it (the module docstring). Owned by one
    ``StubLM``; the oldest entry goes when ``STORE_ENTRIES`` are held."""

    def __init__(self, background_s: float) -> None:
        self.background_s = background_s
        self._stored: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()

    def _status(self, rid: str) -> str:
        created, status = self._stored[rid]
        if status == "queued":  # background: works for background_s
            return "in_progress" if time.monotonic() - created < self.background_s else "completed"
        return status

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON answer) of one Responses route."""
        if path == "/v1/responses" and method == "POST":
            try:
                req = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                req = None
            if not isinstance(req, dict):
                return 400, json.loads(_error(400, "the body must be a JSON object"))
            rid = str(req.get("request_id") or f"resp_{uuid.uuid4().hex}")
            background = req.get("background") is True
            self._stored[rid] = (time.monotonic(), "queued" if background else "completed")
            while len(self._stored) > STORE_ENTRIES:
                self._stored.popitem(last=False)
            out = {"id": rid, "object": "response", "status": "queued" if background else "completed",
                   "model": req.get("model") or MODEL, "output": [] if background else [
                       {"type": "message", "role": "assistant", "content": [
                           {"type": "output_text", "text": TOKEN * DEFAULT_MAX_TOKENS}]}]}
            return 200, out
        rid = path.removeprefix("/v1/responses/").removesuffix("/cancel")
        if rid not in self._stored:
            return 404, {"error": {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                                   "param": None, "code": 404}}
        if path.endswith("/cancel") and method == "POST" and self._status(rid) in ("queued", "in_progress"):
            self._stored[rid] = (self._stored[rid][0], "cancelled")
        return 200, {"id": rid, "object": "response", "status": self._status(rid), "model": MODEL}


class StubLM(lm_pb2_grpc.LMServiceServicer):
    """Answers every Generate with ``max_tokens`` tokens, no waiting (Responses routes from its store)."""

    def __init__(self, background_s: float = 2.0) -> None:
        self.responses = ResponseStore(background_s)

    async def GetInfo(self, request, context):
        return lm_pb2.LMInfo(model=MODEL, compat=transfer_pb2.CompatInfo(model=MODEL))

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        rid = request.request_id
        if request.openai.api == "http" and request.openai.path.startswith("/v1/responses"):
            status, out = self.responses.answer(request.openai.method or "POST", request.openai.path,
                                                request.openai.body)
            yield lm_pb2.GenerateResponse(request_id=rid, http_status=status, openai=json.dumps(out).encode(),
                                          content_type="application/json")
            return
        try:
            body = json.loads(request.openai.body)
        except (ValueError, UnicodeDecodeError) as e:
            body = e
        if not isinstance(body, dict) or request.openai.api not in ("chat", "completions"):
            yield lm_pb2.GenerateResponse(request_id=rid, http_status=400,
                                          openai=_error(400, "openai.body must be a JSON object of api chat "
                                                             f"or completions (api {request.openai.api!r})"))
            return
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        n = limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_TOKENS
        whole, events = answer(rid, request.openai.api, body, n)
        if whole:
            yield lm_pb2.GenerateResponse(request_id=rid, http_status=200, openai=whole)
        for i, event in enumerate(events):
            yield lm_pb2.GenerateResponse(request_id=rid, http_status=0 if i else 200, openai=event)
        yield lm_pb2.GenerateResponse(
            request_id=rid, finish_reason="length", usage=lm_pb2.Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=n),
            timings=lm_pb2.Timings(transfer_ms=0.0, ttft_ms=(time.perf_counter() - t0) * 1e3))


async def serve(host: str, port: int, background_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = GrpcServer(host, port)
    server.add(lm_pb2_grpc.add_LMServiceServicer_to_server, StubLM(background_s), "epd.lm.v1.LMService")
    bound = await server.start()
    await server.set_serving(True)
    logger.info("stub lm ready: %s:%d", host, bound)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--background-s", type=float, default=2.0,
                    help="how long a background Responses request stays in_progress")
    args = ap.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.host, args.port, args.background_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
