"""In-process fake encoder and LM gRPC servers for the gateway's tests (one
place for them): a shared ``World`` records what every fake saw, in order, and
holds the scripts the next calls follow. ``serve_fake`` puts one fake on a real
``grpc.aio`` server with grpc.health.v1 readiness (and, given a ``SecurityConfig``,
the real token check), as the real services do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable

import grpc

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig
from services.common.errors import (
    BadInput,
    EncoderUnavailable,
    Forbidden,
    PeerUnavailable,
    PrefillKVUnavailable,
    RoleMismatch,
)
from services.common.grpc_server import GrpcServer
from services.common.media import content_id
from services.common.protocol import ENCODER_PROTOCOL
from services.lm.servicer import openai_body

ENCODER_SERVICE = "epd.encoder.v1.EncoderService"
LM_SERVICE = "epd.lm.v1.LMService"


class World:
    """What the fakes share: an ordered log of events, per-request "the LM
    call arrived" events, and scripts that the next calls (to whichever
    instance gets them) follow."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []  # (who, what, request_id)
        self.enc_script: list[str] = []
        self.lm_script: list[str] = []
        self._lm_arrived: dict[str, asyncio.Event] = {}
        self.release = asyncio.Event()

    def lm_arrived(self, rid: str) -> asyncio.Event:
        return self._lm_arrived.setdefault(rid, asyncio.Event())

    def at(self, what: str, rid: str) -> int:
        """Position in the log of the first ``what`` event of request ``rid``."""
        return next(n for n, (_, w, r) in enumerate(self.log) if (w, r) == (what, rid))


class FakeEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Streams ItemMetadata per item (transfer_endpoint ``<name>:1``), waits
    for the LM call of the same request (``wait_lm_s``), then ItemEncoded per
    item; GetInfo names it and its endpoint. Scripted modes: unavailable,
    abort_unavailable, invalid, unauthenticated (as a server refusing the
    caller's token), hang, fail_after_metadata, fail_when_released (after
    metadata, once ``world.release`` is set), late_encoded (0.3 s after the LM
    call), hold_encoded (not until cancelled). ``names_items``: it names each item
    as the real encoder does (the content hash of its bytes in the request's
    namespace, a different caller identifier refused) and records in ``hits``
    whether it had encoded that identifier before (its caches are keyed by it)."""

    def __init__(self, name: str, world: World, wait_lm_s: float = 2.0) -> None:
        self.name, self.world, self.wait_lm_s = name, world, wait_lm_s
        self.endpoint = f"{name}:1"
        self.requests: list[encoder_pb2.EncodeRequest] = []
        self.cancelled: list[str] = []
        self.mode = "ok"
        self.layout = False  # send a prompt layout with the metadata, as the real encoder does
        self.protocol = ENCODER_PROTOCOL  # what GetInfo reports (0: an encoder older than ItemSource)
        self.names_items = False
        self.encoded: set[str] = set()  # names_items: the identifiers it encoded
        self.hits: list[bool] = []  # names_items: per item, in order, whether it was encoded before

    async def Encode(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        mode = self.world.enc_script.pop(0) if self.world.enc_script else self.mode
        self.world.log.append((self.name, "encode", rid))
        if mode == "unavailable":
            raise PeerUnavailable(f"{self.name} is going away")
        if mode == "abort_unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} overloaded")
        if mode == "invalid":
            raise BadInput("not an image")
        if mode == "unauthenticated":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refuses the caller's token")
        if mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        idents = [item.identifier for item in request.items]
        if self.names_items:
            idents = [content_id(item.data, request.namespace) for item in request.items]
            for i, (item, ident) in enumerate(zip(request.items, idents)):
                if item.identifier and item.identifier != ident:
                    raise BadInput(f"item {i}: identifier is not the content hash of its bytes in the namespace")
                self.hits.append(ident in self.encoded)
                self.encoded.add(ident)
        for i, (item, ident) in enumerate(zip(request.items, idents)):
            # One claim per reader, as the real encoder makes them (EncodeRequest.readers).
            claims = [f"{rid}-{i}-claim{k}" for k in range(request.readers or 1)]
            md = encoder_pb2.ItemMetadata(identifier=ident, index=i, modality=item.modality,
                                          source=transfer_pb2.ItemSource(
                                              num_embeds=16, embed_width=64, dtype=transfer_pb2.BFLOAT16,
                                              transfer_endpoint=self.endpoint, encoder_id=self.name,
                                              claim=claims[0], extra_claims=claims[1:]))
            if self.layout:
                md.source.placeholder_token_ids.append(9)
                md.source.prompt_token_ids.extend([5] * 16)
            yield encoder_pb2.EncodeEvent(metadata=md)
        self.world.log.append((self.name, "metadata", rid))
        if mode == "fail_when_released":
            await self.world.release.wait()
            self.world.log.append((self.name, "failed", rid))
            raise PeerUnavailable(f"{self.name} died after the LM pulled its items")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.world.lm_arrived(rid).wait(), self.wait_lm_s)
        if mode == "fail_after_metadata":
            raise PeerUnavailable(f"{self.name} died mid-encode")
        if mode == "hold_encoded":  # the engine's last output is held until the caller cancels (30 s at most)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        if mode == "late_encoded":  # the engine's last output comes after the LM answered
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        for i, ident in enumerate(idents):
            yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(identifier=ident, index=i,
                                                                          encode_ms=5.0))
        self.world.log.append((self.name, "encoded", rid))

    async def GetInfo(self, request, context):
        return encoder_pb2.EncoderInfo(encoder_id=self.name, transfer_endpoint=self.endpoint,
                                       protocol=self.protocol)


class FakeLM(lm_pb2_grpc.LMServiceServicer):
    """Records each request and answers it as the real LM does (vLLM's OpenAI bytes, then a last
    message with the timings): tokens [1, 2] ("ab") then [3] ("c"), then "stop" (fewer, and "length",
    under a smaller ``max_tokens``). Without ``"stream": true`` the first message is the whole
    chat.completion (or text_completion) body with http_status 200; with it, one SSE chunk per
    message (the first with http_status 200), then "data: [DONE]". As vLLM with return_token_ids,
    each choice carries its "token_ids"; ids are vLLM's ("chatcmpl-"/"cmpl-" + the body's "request_id") and
    "model" is the request's, else ``model``. GetInfo names ``model``. Scripted modes: unavailable,
    encoder_unavailable, encoder_unavailable_unnamed, kv_unavailable, invalid, forbidden (PERMISSION_DENIED, as an
    LM whose encoder allow-list lacks the item's encoder), bad_request:<param> (an HTTP 400 answer as
    vLLM's error body, as vLLM answers a bad sampling parameter), fail_after_first, block (until
    cancelled), first_then_block, big:<bytes> (64 parts of that many bytes of content: streamed as 64
    events, else one answer; a cancel is recorded). ``role``: what GetInfo says (a prefill LM's last message of a PREFILL
    call carries kv_transfer_params naming it); as the real LM, a hand-off phase the role does not take is
    refused (``RoleMismatch``): set it after start to play an LM restarted with another role."""

    def __init__(self, name: str, world: World, model: str = "fake-model", role: str = "") -> None:
        self.name, self.world, self.model, self.role = name, world, model, role
        self.requests: list[lm_pb2.GenerateRequest] = []
        self.releases: list[lm_pb2.GenerateRequest] = []  # RELEASE calls (kv.phase), kept apart
        self.cancelled: list[str] = []
        self.stored: dict[str, str] = {}  # Responses API: id -> status, as vLLM's store keeps them

    @staticmethod
    def body(request: lm_pb2.GenerateRequest) -> dict:
        """The OpenAI body a request carries (refused as the real LM refuses a malformed one)."""
        return openai_body(request)

    async def Generate(self, request, context):
        got = lm_pb2.GenerateRequest()
        got.CopyFrom(request)
        want = {lm_pb2.KVHandoff.PREFILL: "prefill", lm_pb2.KVHandoff.DECODE: "decode",
                lm_pb2.KVHandoff.RELEASE: "decode"}.get(request.kv.phase)
        if want is not None and (self.role or "both") != want:  # as the real LM: refused before anything runs
            self.world.log.append((self.name, "role_mismatch", request.request_id))
            raise RoleMismatch(f"this LM's role is {self.role or 'both'}: it takes no "
                               f"{lm_pb2.KVHandoff.Phase.Name(request.kv.phase)} call")
        if request.kv.phase == lm_pb2.KVHandoff.RELEASE:  # as a decode LM: one empty message, no script
            self.releases.append(got)
            yield lm_pb2.GenerateResponse(request_id=request.request_id)
            return
        if request.openai.api == "http" and request.openai.path.startswith("/v1/responses"):
            yield self._responses(request)
            return
        self.requests.append(got)
        rid = request.request_id
        self.world.log.append((self.name, "generate", rid))
        self.world.lm_arrived(rid).set()
        mode = self.world.lm_script.pop(0) if self.world.lm_script else "ok"
        body = self.body(request)
        if mode == "unavailable":
            raise PeerUnavailable(f"{self.name} is draining")
        if mode == "encoder_unavailable":  # as the real LM: names the encoder of the item it could not get
            raise EncoderUnavailable("the encoder freed the item before it was pulled",
                                     [request.items[0].source.transfer_endpoint])
        if mode == "encoder_unavailable_unnamed":  # the LM cannot tell which encoder failed
            raise EncoderUnavailable("the encoder output could not be obtained")
        if mode == "kv_unavailable":  # as a decode LM whose KV pull from the prefill LM failed
            raise PrefillKVUnavailable("the prompt's KV could not be loaded from the prefill LM")
        if mode == "invalid":
            raise BadInput("prompt too long")
        if mode == "forbidden":
            raise Forbidden(f"{self.name} may not fetch from that encoder")
        if mode.startswith("bad_request:"):
            param = mode.partition(":")[2]
            err = {"error": {"message": f"{param}: bad value", "type": "BadRequestError", "param": param,
                             "code": 400}}
            yield lm_pb2.GenerateResponse(request_id=rid, openai=json.dumps(err).encode(), http_status=400)
            return
        if mode == "block":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        chat = request.openai.api == "chat"
        if mode.startswith("big:"):
            try:
                async for resp in self._answer(request, body, rid, chat, [([1], "x" * int(mode[4:]))] * 64, mode):
                    yield resp
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.append(rid)
                raise
            return
        async for resp in self._answer(request, body, rid, chat, None, mode):
            yield resp

    async def _answer(self, request, body: dict, rid: str, chat: bool, steps: list | None, mode: str):
        steps = steps or [([1, 2], "ab"), ([3], "c")]
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 3
        if max_tokens < 3:
            steps = [([1, 2][:max_tokens], "ab"[:max_tokens])]
        finish = "stop" if max_tokens >= 3 else "length"
        n_out = sum(len(t) for t, _ in steps)
        usage = {"prompt_tokens": 5, "total_tokens": 5 + n_out, "completion_tokens": n_out}
        # As vLLM: the body's request_id (the client's, which the gateway puts there) names the response.
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + str(body.get("request_id") or uuid.uuid4().hex),
                "created": int(time.time()),
                "model": body.get("model") or self.model}
        if body.get("stream") is True:
            for k, (toks, text) in enumerate(steps):
                last = k == len(steps) - 1
                choice = {"index": 0, "logprobs": None, "finish_reason": finish if last else None,
                          "token_ids": toks}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": text} if k == 0 else {"content": text}
                else:
                    choice["text"] = text
                chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion",
                         "choices": [choice]}
                yield lm_pb2.GenerateResponse(request_id=rid, openai=_sse(chunk), http_status=200 if k == 0 else 0)
                if k == 0:
                    await self._after_first(mode, rid)
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                yield lm_pb2.GenerateResponse(request_id=rid, openai=_sse(
                    {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [],
                     "usage": usage}))
            yield lm_pb2.GenerateResponse(request_id=rid, openai=b"data: [DONE]\n\n")
        else:
            toks, text = [t for s in steps for t in s[0]], "".join(s[1] for s in steps)
            choice = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": toks}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                   "usage": usage}
            yield lm_pb2.GenerateResponse(request_id=rid, openai=json.dumps(out).encode(), http_status=200)
            await self._after_first(mode, rid)
        # A PREFILL call hands over where its KV is, as vLLM's NixlConnector names it.
        kv = json.dumps({"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [0],
                         "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": rid}).encode() \
            if request.kv.phase == lm_pb2.KVHandoff.PREFILL else b""
        yield lm_pb2.GenerateResponse(
            request_id=rid, finish_reason=finish,
            usage=lm_pb2.Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=n_out),
            timings=lm_pb2.Timings(ttft_ms=1.0, tpot_ms=0.5),
            transferred_items=sum(1 for i in request.items if i.HasField("source")), kv_transfer_params=kv)

    def _responses(self, request) -> lm_pb2.GenerateResponse:
        """vLLM's Responses routes, as far as the gateway reads them: POST stores a response under the body's
        ``request_id`` ("queued" in the background, else "completed"), GET answers it or 404, cancel marks it
        cancelled. A test moves a background one along by setting ``stored[id]``."""
        path, method = request.openai.path, request.openai.method or "POST"
        self.world.log.append((self.name, f"{method} {path}", request.request_id))
        if path == "/v1/responses" and method == "POST":
            body = self.body(request)
            rid = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
            self.stored[rid] = "queued" if body.get("background") else "completed"
        else:
            rid = path.removeprefix("/v1/responses/").removesuffix("/cancel")
            if rid not in self.stored:
                err = {"error": {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                                 "param": None, "code": 404}}
                return lm_pb2.GenerateResponse(request_id=request.request_id, openai=json.dumps(err).encode(),
                                               http_status=404, content_type="application/json")
            if path.endswith("/cancel"):
                self.stored[rid] = "cancelled"
        out = {"id": rid, "object": "response", "status": self.stored[rid], "model": self.model}
        return lm_pb2.GenerateResponse(request_id=request.request_id, openai=json.dumps(out).encode(),
                                       http_status=200, content_type="application/json")

    async def _after_first(self, mode: str, rid: str) -> None:
        if mode == "fail_after_first":
            raise PeerUnavailable(f"{self.name} crashed mid-stream")
        if mode == "first_then_block":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise

    async def GetInfo(self, request, context):
        return lm_pb2.LMInfo(model=self.model, role=self.role)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def serve_fake(fake: FakeEncoder | FakeLM, port: int = 0,
                     security: SecurityConfig | None = None) -> tuple[GrpcServer, str]:
    """``fake`` on a started, SERVING GrpcServer on loopback (``security``: its TLS and token check, as a
    real service's); returns it and its ``127.0.0.1:port``. The caller stops the server."""
    server = GrpcServer("127.0.0.1", port, security)
    if isinstance(fake, FakeEncoder):
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, fake, ENCODER_SERVICE)
    else:
        server.add(lm_pb2_grpc.add_LMServiceServicer_to_server, fake, LM_SERVICE)
    port = await server.start()
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


WAIT_FLOOR_S = 20.0
"""The least time ``wait_until`` gives a state to come about: a deadline only bounds a hang, so a slow,
busy host (health rounds, gRPC round trips, cancellations crossing a call) is never failed for being late."""


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls ``predicate`` until it holds; AssertionError after ``timeout`` (at least ``WAIT_FLOOR_S``)."""
    timeout = max(timeout, WAIT_FLOOR_S)
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0
