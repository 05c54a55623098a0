"""LMService handlers: Generate and GetInfo.

Generate answers an OpenAI request (``GenerateRequest.openai``) with vLLM's own
serving classes (``services.lm.frontend``): the same validation, sampling
parameters, chat rendering, structured outputs, tool and reasoning parsing,
logprobs and streaming as ``vllm serve``, and vLLM's response bytes are passed on
unchanged. What epd adds: each item's encoder (``items``), so the consumer
connector in the engine pulls its embedding and the prompt is laid out from the
encoder's metadata (no image processing here), and a last message with the
request's timings. A cancelled call closes vLLM's generator, which aborts the
engine request and releases its staging reservations through the connector's
``request_finished``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from prometheus_client import Counter, Histogram
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import GenerationError, VLLMClientError

from ectransfer import tensors
from ectransfer.connector.metadata import ConsumerFinished, ItemSource, TransferReport
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from services.common.errors import BadInput, EPDError, PrefillKVUnavailable
from services.common.layout import ItemLayout
from services.common.media import MediaDecoder, check_namespace
from services.common.vllm_media import processor_audio_rate
from services.fleet_memory.holdings import Holdings
from services.fleet_memory.prefix import KEY_PREFIX
from services.lm import handoff
from services.lm.context import CURRENT, RequestContext
from services.lm.frontend import Frontend, validation_error
from services.lm.handoff import DECODE, PREFILL, RELEASE, Handoff
from services.lm.media import RequestMedia
from services.lm.peers import PeerChecker
from services.lm.response_store import StoredResponses
from services.lm.signals import WAITING
from services.lm.vllm_app import Started, call

logger = logging.getLogger(__name__)

REQUESTS = Counter("epd_lm_requests_total", "Generate calls", ["status"])
LOCAL_ENCODER_RUNS = Counter("epd_lm_local_encoder_runs_total", "Items this LM had to encode itself")
TRANSFERRED = Counter("epd_lm_transferred_items_total", "Items whose embedding arrived from an encoder")
KV_HANDOFFS = Counter("epd_lm_kv_handoffs_total", "E -> P -> D calls by phase (prefill, decode, release) and "
                      "outcome: ok, refused (answered before the engine, e.g. vLLM's validation), kv_unavailable "
                      "(a decode LM that could not load the prefill LM's KV), cancelled, error", ["phase", "outcome"])
LAYOUTS = Counter("epd_lm_prompt_layouts_total", "Multimodal prompts by who laid them out: the encoder's "
                  "metadata, or this LM's image processor", ["by"])
TTFT = Histogram("epd_lm_ttft_seconds", "Arrival at the LM to first token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
TRANSFER = Histogram("epd_lm_transfer_seconds", "Time a request waited for encoder outputs",
                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))

_APIS = ("chat", "completions", "http")


def _dumps(model) -> bytes:
    # As vLLM's server sends a model: JSONResponse(model.model_dump()).
    return json.dumps(model.model_dump(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _parsed(request: lm_pb2.GenerateRequest) -> tuple[dict, bool]:
    """The OpenAI body a GenerateRequest carries, parsed once as vLLM parses it (``json.loads``, so an
    escaped key is the same key), the kv params dropped (``handoff.strip``), and whether they were there;
    BadInput for an unknown ``api`` or a body that is not a JSON object (everything inside it is vLLM's
    to validate)."""
    if request.openai.api not in _APIS:
        raise BadInput(f"openai.api must be one of {', '.join(_APIS)}; got {request.openai.api!r}")
    if request.openai.api == "http" and not request.openai.body:
        return {}, False  # a GET
    try:
        body = json.loads(request.openai.body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"openai.body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadInput("openai.body must be a JSON object")
    return body, handoff.strip(body)


def openai_body(request: lm_pb2.GenerateRequest) -> dict:
    """The OpenAI body a GenerateRequest carries, as a dict, without the kv params (``_parsed``)."""
    return _parsed(request)[0]


def vllm_body(request: lm_pb2.GenerateRequest, prefill_responses: bool = False) -> tuple[dict, bytes]:
    """A JSON body for vLLM's app: the parsed body (``_parsed``) and its bytes, the kv params dropped
    (and ``handoff.PREFILL_ONLY`` set for a Responses request's prefill call); re-encoded only when it changed."""
    body, stripped = _parsed(request)
    raw = request.openai.body
    if not raw or not (stripped or prefill_responses):
        return body, raw
    return body, json.dumps({**body, **handoff.PREFILL_ONLY} if prefill_responses else body, ensure_ascii=False).encode()


class LMServicer(lm_pb2_grpc.LMServiceServicer):
    def __init__(self, engine, info: lm_pb2.LMInfo, peers: PeerChecker, frontend: Frontend,
                 decoder: MediaDecoder, stored: StoredResponses | None = None, holdings: Holdings | None = None) -> None:
        """``decoder``: the service's media limits and decode budget, for the media this LM decodes
        itself (data: URLs from the gateway; ``services.lm.media``); ``stored``: the bound on the
        Responses vLLM stores here, shared between tenants (``services.lm.response_store``), trimmed after
        each Responses call."""
        self.engine = engine
        self.info = info
        self.peers = peers
        self.frontend = frontend
        self.decoder = decoder
        self.stored = stored
        self.holdings = holdings
        self.audio_rate = processor_audio_rate(getattr(engine, "renderer", None))
        """The rate the model's processor resamples audio to: chat audio this LM decodes is charged for it."""
        """What the prefix cache holds, by media item (``services.fleet_memory.holdings``); None: not published."""

    async def GetInfo(self, request, context):
        return self.info

    async def Holdings(self, request, context):
        if self.holdings is None:  # --no-holdings: an epoch of its own that never holds anything
            return transfer_pb2.HoldingsReply(epoch="off", generation=0, changed=request.epoch != "off")
        epoch, generation, items = self.holdings.snapshot()
        if request.epoch == epoch and request.generation == generation:
            return transfer_pb2.HoldingsReply(epoch=epoch, generation=generation, changed=False)
        return transfer_pb2.HoldingsReply(epoch=epoch, generation=generation, changed=True, items=items)

    def _context(self, request: lm_pb2.GenerateRequest, kv: Handoff) -> RequestContext:
        ctx = RequestContext(media=RequestMedia(self.decoder, request.request_id, check_namespace(request.namespace),
                                                      audio_rate=self.audio_rate))
        kv.check(self.info.role)  # the gateway's E -> P -> D phase: one this LM's role takes
        ctx.kv = kv
        if request.prefix_key.startswith(KEY_PREFIX) and len(request.prefix_key) <= 64:
            ctx.prefix_key = request.prefix_key
        for item in request.items:
            if not item.identifier or not item.HasField("source"):
                continue
            if not self.peers.consumer_id:  # the encoder-decoder guard: such a model's LM is no EC consumer
                raise BadInput(f"item {item.identifier}: this LM takes no encoder outputs (it serves an "
                               "encoder-decoder model and encodes its media itself)")
            src = item.source
            try:
                ctx.sources[item.identifier] = ItemSource(
                    src.transfer_endpoint, src.embed_width, tensors.dtype_name(tensors.dtype_from_proto(src.dtype)),
                    src.claim)
            except ValueError as e:
                raise BadInput(f"item {item.identifier}: {e}") from None
            if src.mm_kwargs:
                try:
                    ctx.mm_kwargs[item.identifier] = decode_mm_kwargs_item(src.mm_kwargs)
                except Exception as e:  # noqa: BLE001 - whatever the decoder refuses is bad input
                    raise BadInput(f"item {item.identifier}: unreadable mm_kwargs: {e}") from None
            if src.placeholder_token_ids:
                lay = ItemLayout(tuple(src.placeholder_token_ids), tuple(src.prompt_token_ids), src.is_embed)
                if (lay.is_embed and len(lay.is_embed) != len(lay.tokens)) or lay.num_embeds != src.num_embeds:
                    raise BadInput(f"item {item.identifier}: its prompt layout does not match its "
                                   f"{src.num_embeds} embedding rows")
                ctx.layouts[item.identifier] = lay
        return ctx

    async def _answer(self, request: lm_pb2.GenerateRequest, ctx: RequestContext):
        """vLLM's answer to the request: (status, body) once, or an async generator of SSE events."""
        api = request.openai.api
        body = openai_body(request)
        serving = self.frontend.chat if api == "chat" else self.frontend.completion
        try:
            req = (ChatCompletionRequest if api == "chat" else CompletionRequest).model_validate(body)
        except ValidationError as e:
            return validation_error(self.frontend, e)
        except VLLMClientError as e:  # vLLM's own validators raise these through pydantic
            err = serving.create_error_response(e)
            return err.error.code, _dumps(err)
        try:
            out = await (serving.create_chat_completion(req) if api == "chat" else serving.create_completion(req))
        except (ValueError, VLLMClientError) as e:  # vLLM's input validation, as its server answers it
            if ctx.failure is not None:
                raise ctx.failure from None
            out = serving.create_error_response(e)
        if ctx.failure is not None:
            raise ctx.failure
        if isinstance(out, ErrorResponse):
            return out.error.code, _dumps(out)
        if hasattr(out, "model_dump"):
            if getattr(out, "ec_transfer_params", None) is not None:
                out.ec_transfer_params = None  # the connector's report is for the service (timings), not the client
            return 200, _dumps(out)
        return out

    async def Generate(self, request, context):
        rid = request.request_id
        kv = Handoff.of(request)
        try:
            ctx = self._context(request, kv)
        except EPDError:
            # Refused before anything ran (a bad item, a phase this LM's role does not take): a DECODE
            # call's prefill LM still pins the prompt's blocks for it.
            REQUESTS.labels("error").inc()
            if kv.params is not None:
                await handoff.release(self.engine, rid, kv.params)
            raise
        if kv.phase == RELEASE:  # the gateway's DECODE call will not come: let the prefill LM's blocks go
            await handoff.release(self.engine, rid, kv.params)
            KV_HANDOFFS.labels("release", "ok").inc()
            yield lm_pb2.GenerateResponse(request_id=rid)
            return
        status = "error"
        # Set in this call's own task (grpc runs each call in one), never reset: a generator closed
        # from another task could not reset it there.
        CURRENT.set(ctx)
        WAITING.track(ctx)  # epd_lm_waiting_for_items (a scaling signal) counts it while it waits for its items
        try:
            for endpoint in {s.endpoint for s in ctx.sources.values()}:
                await self.peers.check(endpoint)
            try:
                if request.openai.api == "http":
                    async for msg in self._http(request, ctx):
                        yield msg
                    status = "ok"
                    return
                # aclosing: if the client goes away while we sit at a yield, grpc closes this
                # handler (GeneratorExit); closing vLLM's generator right then aborts the
                # engine request and frees its reservations.
                async with contextlib.aclosing(self._openai(request, ctx)) as messages:
                    async for msg in messages:
                        yield msg
            except GenerationError as e:  # the engine failed the request: vLLM's server answers 500
                if ctx.failure is not None:
                    raise ctx.failure from None
                raise EPDError(f"request {rid}: {e}") from None
            yield self._last(rid, ctx)
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            WAITING.forget(ctx)
            if ctx.media is not None:
                ctx.media.release()  # normally done once the prompt was processed
            if kv.phase == DECODE and (not ctx.submitted or (status == "error" and ctx.final is None)):
                # Refused before the engine (vLLM's validation, a bad item), or failed before its first
                # output (vLLM's input processing runs on the generator's first step): the prefill LM may
                # still pin the prompt's blocks for us; vLLM's own hook tells it to let them go (a prefill
                # LM that already let them go logs the notice and ignores it).
                await handoff.release(self.engine, rid, kv.params)
            REQUESTS.labels(status).inc()
            if kv.phase:
                KV_HANDOFFS.labels(kv.name, _kv_outcome(status, ctx)).inc()

    async def _openai(self, request: lm_pb2.GenerateRequest, ctx: RequestContext):
        """A chat or completions request's answer (``_answer``) as messages: one with the status and
        the whole body, or one per SSE event (the first with the status)."""
        rid = request.request_id
        answer = await self._answer(request, ctx)
        if isinstance(answer, tuple):
            code, payload = answer
            yield lm_pb2.GenerateResponse(request_id=rid, openai=payload, http_status=code)
            return
        async with contextlib.aclosing(answer) as events:  # closed with this generator (see Generate)
            first = True
            async for event in events:
                if ctx.failure is not None:  # vLLM made an error event of it
                    raise ctx.failure
                yield lm_pb2.GenerateResponse(request_id=rid, openai=event.encode(),
                                              http_status=200 if first else 0)
                first = False

    async def _http(self, request: lm_pb2.GenerateRequest, ctx: RequestContext):
        """A route of vLLM's own app (``services.lm.vllm_app``): the first message has the status,
        content type and the whole body (or, for a stream, its first chunk; each further chunk is a
        message); the last one the request's facts, as for chat."""

        content_type = request.openai.content_type
        raw = request.openai.body
        method, path = request.openai.method or "POST", request.openai.path
        responses = path.startswith("/v1/responses")
        response_id = ""
        if not content_type.lower().startswith("multipart/"):  # an upload is vLLM's to parse (body_type)
            # A JSON object (or nothing, for a GET): everything inside is vLLM's to read, but for
            # the kv params (only the gateway's KVHandoff names a prefill engine).
            body, raw = vllm_body(request, prefill_responses=ctx.kv.phase == PREFILL
                                  and path.rstrip("/") == "/v1/responses")
            if responses and method == "POST" and isinstance(body.get("request_id"), str):
                response_id = body["request_id"]  # vLLM's id for the response it may store
        try:
            async for message in self._relay(request, ctx, method, path, raw, content_type):
                yield message
        finally:
            if responses and self.stored is not None:
                await self.stored.forget_unstored(response_id)
                # A response this call stored is its tenant's (the namespace), within the tenant's share.
                await self.stored.trim(response_id, request.namespace, request.tenant_weight)

    async def _relay(self, request: lm_pb2.GenerateRequest, ctx: RequestContext, method: str, path: str,
                     raw: bytes, content_type: str):
        rid = request.request_id
        async with contextlib.aclosing(call(self.frontend.app, method, path, raw,
                                            content_type)) as answer:
            started: Started | None = None
            body: list[bytes] = []  # a plain response's chunks, sent as one message
            streamed = 0
            async for part in answer:
                if ctx.failure is not None:
                    raise ctx.failure
                if isinstance(part, Started):
                    started = part
                elif started.content_type.startswith("text/event-stream"):
                    yield lm_pb2.GenerateResponse(request_id=rid, openai=part,
                                                  http_status=0 if streamed else started.status,
                                                  content_type="" if streamed else started.content_type)
                    streamed += 1
                else:
                    body.append(part)
        if ctx.failure is not None:
            raise ctx.failure
        if not streamed:
            yield lm_pb2.GenerateResponse(request_id=rid, openai=b"".join(body),
                                          http_status=started.status, content_type=started.content_type)
        yield self._last(rid, ctx)

    def _last(self, rid: str, ctx: RequestContext) -> lm_pb2.GenerateResponse:
        final = ctx.final
        ec = ConsumerFinished.from_dict(ctx.ec_report).report \
            or TransferReport()
        if ctx.laid_out:
            LAYOUTS.labels("encoder").inc()
        elif ec.local_encoder_runs or ec.transferred_items:  # multimodal, laid out by vLLM's processor here
            LAYOUTS.labels("processor").inc()
        LOCAL_ENCODER_RUNS.inc(ec.local_encoder_runs)
        TRANSFERRED.inc(ec.transferred_items)
        if ec.transfer_ms:
            TRANSFER.observe(ec.transfer_ms / 1e3)
        ttft_ms = ((ctx.first_token_at or time.perf_counter()) - ctx.start) * 1e3
        if ctx.first_token_at:
            TTFT.observe(ttft_ms / 1e3)
        outputs = final.outputs if final is not None else []
        tpot = (ctx.last_token_at - ctx.first_token_at) * 1e3 / (ctx.first_choice_tokens - 1) \
            if ctx.first_choice_tokens > 1 else 0.0
        return lm_pb2.GenerateResponse(
            request_id=rid, finish_reason=(outputs[0].finish_reason or "") if outputs else "",
            usage=lm_pb2.Usage(prompt_tokens=len((final.prompt_token_ids if final is not None else None) or []),
                               completion_tokens=ctx.completion_tokens),
            timings=lm_pb2.Timings(transfer_ms=ec.transfer_ms, ttft_ms=ttft_ms, tpot_ms=tpot,
                                   lm_queue_ms=_queue_ms(final, ec.transfer_ms)),
            local_encoder_runs=ec.local_encoder_runs,
            transferred_items=ec.transferred_items,
            **handoff.response_fields(ctx.kv, ctx.kv_report),
            transports=[ec.transports.get(s.endpoint) or self.peers.transport.get(s.endpoint, "")
                        for s in ctx.sources.values()] if ec.transferred_items else [],
        )


def _kv_outcome(status: str, ctx: RequestContext) -> str:
    """A hand-off call's outcome for ``epd_lm_kv_handoffs_total``."""
    if isinstance(ctx.failure, PrefillKVUnavailable):
        return "kv_unavailable"
    if status == "ok":
        return "ok" if ctx.submitted else "refused"
    return status  # cancelled, error


def _queue_ms(output, transfer_ms: float) -> float:
    """Queued-to-scheduled time from vLLM's per-request stats, less the part the
    connector spent deferring the request for its embeddings."""
    m = getattr(output, "metrics", None)
    if m is None or not getattr(m, "scheduled_ts", 0) or not getattr(m, "queued_ts", 0):
        return 0.0
    return max(0.0, (m.scheduled_ts - m.queued_ts) * 1e3 - transfer_ms)
