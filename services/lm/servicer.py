"""LMService handlers: Generate and GetInfo.

Generate hands vLLM the prompt, laid out from the encoders' metadata (no
image processing here; the items carry no data) or, for items without a
layout, with the media for vLLM's processor, and, per item, the encoder it
comes from (``ec_transfer_params``); the consumer connector inside the engine
pulls the embeddings. A cancelled call aborts the engine request, which releases its
staging reservations through the connector's ``request_finished``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from prometheus_client import Counter, Histogram

from ectransfer import tensors
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.common.chat import render_chat
from services.common.engine import tokenize_async
from services.common.errors import BadInput, EncoderUnavailable, EPDError
from services.common.layout import ItemLayout, splice
from services.common.media import ImageDecoder, content_id
from services.lm.peers import PeerChecker

logger = logging.getLogger(__name__)

REQUESTS = Counter("epd_lm_requests_total", "Generate calls", ["status"])
LOCAL_ENCODER_RUNS = Counter("epd_lm_local_encoder_runs_total", "Items this LM had to encode itself")
TRANSFERRED = Counter("epd_lm_transferred_items_total", "Items whose embedding arrived from an encoder")
LAYOUTS = Counter("epd_lm_prompt_layouts_total", "Multimodal prompts by who laid them out: the encoder's "
                  "metadata, or this LM's image processor", ["by"])
TTFT = Histogram("epd_lm_ttft_seconds", "Arrival at the LM to first token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
TRANSFER = Histogram("epd_lm_transfer_seconds", "Time a request waited for encoder outputs",
                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))


class LMServicer(lm_pb2_grpc.LMServiceServicer):
    def __init__(self, engine, info: lm_pb2.LMInfo, peers: PeerChecker, default_max_tokens: int,
                 decoder: ImageDecoder) -> None:
        self.engine = engine
        self.decoder = decoder
        self.max_images = engine.model_config.multimodal_config.get_limit_per_prompt("image")
        self.info = info
        self.peers = peers
        self.default_max_tokens = default_max_tokens
        self.max_model_len = engine.model_config.max_model_len

    async def GetInfo(self, request, context):
        return self.info

    def _sampling(self, s: lm_pb2.SamplingOptions, sources: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if s.HasField("n") and s.n != 1:
            raise BadInput(f"n={s.n} is not supported (only 1)")
        temperature = s.temperature if s.HasField("temperature") else 1.0
        if temperature < 0:
            raise BadInput(f"temperature must be >= 0, got {temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not 0 < top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1], got {top_p}")
        max_tokens = s.max_tokens or self.default_max_tokens
        if max_tokens >= self.max_model_len:
            raise BadInput(f"max_tokens={max_tokens} exceeds the model's context ({self.max_model_len})")
        return SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens,
            seed=s.seed if s.HasField("seed") else None, stop=list(s.stop) or None, ignore_eos=s.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"ec_transfer_params": {"items": sources}} if sources else None,
        )

    async def _prompt(self, request: lm_pb2.GenerateRequest) -> tuple[str, list[int]]:
        """Prompt text and the item indices in prompt order."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            return request.prompt, list(range(len(request.items)))
        if kind != "chat" or not request.chat.messages:
            raise BadInput("GenerateRequest needs chat messages or a prompt")
        order, messages = [], []
        for m in request.chat.messages:
            parts = []
            for p in m.content:
                if p.WhichOneof("part") == "text":
                    parts.append({"type": "text", "text": p.text})
                else:
                    if p.item_index >= len(request.items):
                        raise BadInput(f"content refers to item {p.item_index}, request has {len(request.items)}")
                    order.append(p.item_index)
                    parts.append({"type": "image"})
            messages.append({"role": m.role or "user", "content": parts})
        try:
            return render_chat(self.engine.get_tokenizer(), messages), order
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise BadInput(f"chat template failed: {e}") from None

    async def _processed(self, prompt: str, items, order: list[int], params, rid: str):
        """The request run through vLLM's processor, which lays out the prompt
        from the images (items without a layout from an encoder). Each item's
        identifier, vLLM's mm_hash, is the content hash of its bytes, computed
        here: a caller's identifier that differs is refused, so no request can
        label one image's bytes with another's hash in vLLM's caches. The decoded
        images hold the decode budget only until the processor has its tensors
        (released here, also on failure), not while the request queues in the engine."""
        from vllm.exceptions import VLLMClientError

        idents = []
        for i, item in zip(order, items):
            if not item.data:
                raise BadInput(f"item {i}: no media bytes, and no prompt layout from an encoder")
            ident = content_id(item.data)
            if item.identifier and item.identifier != ident:
                raise BadInput(f"item {i}: identifier {item.identifier[:16]!r}... is not the content hash of "
                               f"its bytes")
            idents.append(ident)
        engine_prompt: dict = {"prompt": prompt}
        lease = None
        if items:
            images, lease = await self.decoder.decode([item.data for item in items], self.max_images, rid)
            engine_prompt["multi_modal_data"] = {"image": images}
            engine_prompt["multi_modal_uuids"] = {"image": idents}
            del images
        try:
            return await self.engine.input_processor.process_inputs_async(
                rid, engine_prompt, params, supported_tasks=await self.engine.get_supported_tasks())
        except (ValueError, VLLMClientError) as e:  # vLLM's input validation: the caller's input
            raise BadInput(str(e)) from None
        finally:
            del engine_prompt  # the processor's tensors replace the decoded images
            if lease is not None:
                lease.release()

    async def _laid_out(self, prompt: str, items):
        """The prompt laid out from the encoders' metadata (``services.common.layout``):
        tokenized as vLLM tokenizes it, each placeholder replaced by its item's
        tokens. The items carry no data: the connector loads every embedding
        (a failed load fails the request, it never falls back to the vision tower)."""
        import torch
        from vllm.inputs import mm_input
        from vllm.multimodal.inputs import PlaceholderRange

        layouts = []
        for item in items:
            src = item.source
            lay = ItemLayout(tuple(src.placeholder_token_ids), tuple(src.prompt_token_ids), src.is_embed)
            if (lay.is_embed and len(lay.is_embed) != len(lay.tokens)) or lay.num_embeds != src.num_embeds:
                raise BadInput(f"item {item.identifier}: its prompt layout does not match its {src.num_embeds} "
                               f"embedding rows")
            layouts.append(lay)
        try:
            ids, positions = splice(await tokenize_async(self.engine.renderer, prompt), layouts)
        except ValueError as e:  # LayoutError, or vLLM's validation of the text
            raise BadInput(str(e)) from None
        ranges = [PlaceholderRange(offset=off, length=length,
                                   is_embed=torch.frombuffer(bytearray(lay.is_embed), dtype=torch.uint8).bool()
                                   if lay.is_embed else None)
                  for (off, length), lay in zip(positions, layouts)]
        return mm_input(ids, {"image": [None] * len(items)}, {"image": [it.identifier for it in items]},
                        {"image": ranges}, prompt=prompt)

    async def Generate(self, request, context):
        from vllm.exceptions import VLLMClientError

        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        status = "error"
        try:
            prompt, order = await self._prompt(request)
            items = [request.items[i] for i in order]
            if len(items) > self.max_images:
                raise BadInput(f"{len(items)} images in one prompt; this LM allows at most {self.max_images} "
                               "(--max-images-per-prompt)")
            sources = {}
            for item in items:
                if item.HasField("source") and item.identifier:
                    src = item.source
                    sources[item.identifier] = {
                        "endpoint": src.transfer_endpoint,
                        "embed_width": src.embed_width,
                        "dtype": tensors.dtype_name(tensors.dtype_from_proto(src.dtype)),
                    }
            params = self._sampling(request.sampling, sources)
            if items and all(it.identifier and it.source.placeholder_token_ids for it in items):
                engine_prompt = await self._laid_out(prompt, items)
                LAYOUTS.labels("encoder").inc()
            else:
                engine_prompt = await self._processed(prompt, items, order, params, rid)
                if items:
                    LAYOUTS.labels("processor").inc()
            for endpoint in {s["endpoint"] for s in sources.values()}:
                await self.peers.check(endpoint)
            n_out, first, final = 0, None, None
            try:
                # aclosing: if the client goes away while we sit at a yield, grpc
                # closes this handler (GeneratorExit); closing vLLM's generator
                # right then aborts the engine request and frees its reservations.
                async with contextlib.aclosing(self.engine.generate(engine_prompt, params, rid,
                                                                    prompt_text=prompt)) as outputs:
                    async for out in outputs:
                        final = out
                        c = out.outputs[0]
                        if c.finish_reason == "error":
                            break
                        if first is None and c.token_ids:
                            first = time.perf_counter()
                            TTFT.observe(first - t0)
                        n_out += len(c.token_ids)
                        if not out.finished:
                            yield lm_pb2.GenerateResponse(request_id=rid, token_ids=c.token_ids, text=c.text)
            except (ValueError, VLLMClientError) as e:  # vLLM's input validation (a prompt too long, ...)
                raise BadInput(str(e)) from None
            ec = (final.ec_transfer_params if final is not None else None) or {}
            c = final.outputs[0]
            if c.finish_reason == "error":
                endpoints = sorted({s["endpoint"] for s in sources.values()})
                if not endpoints:
                    raise EPDError(f"request {rid}: the engine failed the request")
                for endpoint in endpoints:
                    self.peers.forget(endpoint)
                # vLLM drops the connector's ec_transfer_params when it fails a request
                # (take_unavailable_requests), so without them every encoder the request
                # used is named: the gateway re-encodes elsewhere rather than retry blind.
                failed = ec.get("failed_endpoints") or endpoints
                raise EncoderUnavailable(ec.get("error") or f"request {rid}: an embedding from encoder(s) "
                                         f"{', '.join(failed)} could not be obtained", failed)
            LOCAL_ENCODER_RUNS.inc(ec.get("local_encoder_runs", 0))
            TRANSFERRED.inc(ec.get("transferred_items", 0))
            if ec.get("transfer_ms"):
                TRANSFER.observe(ec["transfer_ms"] / 1e3)
            yield lm_pb2.GenerateResponse(
                request_id=rid, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason or "stop",
                usage=lm_pb2.Usage(prompt_tokens=len(final.prompt_token_ids or []), completion_tokens=n_out),
                timings=lm_pb2.Timings(transfer_ms=ec.get("transfer_ms", 0.0),
                                       ttft_ms=((first or time.perf_counter()) - t0) * 1e3,
                                       lm_queue_ms=_queue_ms(final, ec.get("transfer_ms", 0.0))),
                local_encoder_runs=ec.get("local_encoder_runs", 0),
                transferred_items=ec.get("transferred_items", 0),
                transports=[(ec.get("transports") or {}).get(s["endpoint"]) or self.peers.transport.get(s["endpoint"], "")
                            for s in sources.values()]
                if ec.get("transferred_items") else [],
            )
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            await self.engine.abort(rid)
            raise
        finally:
            REQUESTS.labels(status).inc()


def _queue_ms(output, transfer_ms: float) -> float:
    """Queued-to-scheduled time from vLLM's per-request stats, less the part the
    connector spent deferring the request for its embeddings."""
    m = getattr(output, "metrics", None)
    if m is None or not getattr(m, "scheduled_ts", 0) or not getattr(m, "queued_ts", 0):
        return 0.0
    return max(0.0, (m.scheduled_ts - m.queued_ts) * 1e3 - transfer_ms)
