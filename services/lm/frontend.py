"""The LM's OpenAI front end: vLLM's own serving classes, as ``vllm serve`` builds them.

``build_frontend`` makes vLLM's ``OpenAIServingChat`` and ``OpenAIServingCompletion``
(their request validation, ``to_sampling_params``, structured outputs, tool-call and
reasoning parsers, logprobs, streaming and usage) over the LM's engine, configured
from vLLM's own serve flags (``make_arg_parser``), so every request and every error is
answered by the code ``vllm serve`` runs. epd-serve adds two things, both by
composition on the objects vLLM takes as arguments (no subclass of a serving class,
no patch):

- ``LaidOutRenderer`` wraps the engine's renderer. vLLM parses and renders the chat (its
  chat template, tools, chat-template kwargs) as always; right after vLLM's parser, every
  multimodal item it found is checked (``services.lm.media.check_items``: only what the
  gateway sends gets through, whatever shape a content part has). For the items an
  encoder processed, which arrive as vLLM's uuid-only items (``{"type": "image_url",
  "image_url": null, "uuid": id}``), it splices in each item's prompt layout from the
  encoder's metadata instead of running the image processor: the LM never decodes or
  preprocesses such an item. Anything else (text, or media the gateway sent as data: URLs
  when no encoder was used) is tokenized and processed by vLLM's renderer unchanged; the
  media themselves are loaded by the LM's media connector (``services.lm.media_connector``).
- ``ConsumerEngine`` wraps the engine client: each request's ``SamplingParams`` get the
  ``ec_transfer_params`` naming the encoder of each item (the consumer connector pulls
  the embeddings), and the engine outputs are recorded for the service's timings and
  its failover signal (an item the encoder could not deliver).

This module is the LM's one reach into vLLM beyond its public API: every private vLLM name the
LM uses is imported here, at the top (``_format_error``, for ``validation_error``), and checked by
name in ``tests/unit/test_vllm_private_names.py``.

Both read the request's ``RequestContext`` (``services.lm.context.CURRENT``), which the
servicer sets around each call: vLLM's serving code runs in the servicer's task, so the
context reaches the renderer, the media connector and the engine call of that request and
no other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
from vllm.entrypoints.launchers.cli_args import (
    make_arg_parser,
    resolve_default_chat_template_kwargs,
    validate_parsed_serve_args,
)
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.exception_handling.handlers.validation import _format_error
from vllm.inputs import mm_input
from vllm.multimodal.inputs import PlaceholderRange
from vllm.renderers.chat_utils import load_chat_template
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ectransfer.connector.metadata import ConsumerFinished, ECTransferParams
from services.common.errors import BadInput, EncoderUnavailable, PrefillKVUnavailable
from services.common.layout import ItemLayout, splice_modalities
from services.lm import handoff
from services.lm.config import FrontendConfig
from services.lm.context import CURRENT, RequestContext
from services.lm.media import EncodedElsewhere, check_items
from services.lm.speech import mm_hashes, name_windows
from services.lm.vllm_app import build_vllm_app

logger = logging.getLogger(__name__)


class LaidOutRenderer:
    """vLLM's renderer (``engine.renderer``) with one change: a chat whose images (or audio
    clips) are uuid-only items that the current request's ``RequestContext`` lays out is
    rendered and tokenized by vLLM, then each item's placeholder is replaced by the encoder's
    layout (``services.common.layout.splice_modalities``) instead of running the processor.
    Every other attribute is the wrapped renderer's."""

    def __init__(self, inner, metadata_fields: dict[str, set[str]] | None = None, encoder_decoder: bool = False) -> None:
        self._inner = inner
        self._metadata_fields = metadata_fields or {}  # per modality, what each item must bring (Qwen-VL: its grid)
        self._encoder_decoder = encoder_decoder  # Whisper-class: speech windows are named (name_windows)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def render_messages_async(self, messages, params):
        """vLLM's parsing and chat template, then ``check_items``: every parsed item must be one the
        gateway sent (the one way prompts are rendered here, whoever calls)."""
        conv, prompt = await self._inner.render_messages_async(messages, params)
        check_items(prompt, CURRENT.get() or RequestContext())
        return conv, prompt

    async def render_cmpl_async(self, prompts, *args, **kwargs):
        """vLLM's, with each speech window an encoder cut for this request named by its samples first
        (``services.lm.speech.name_windows``): vLLM's speech-to-text serving renders its windows' prompts here."""
        ctx = CURRENT.get()
        if self._encoder_decoder and ctx is not None and ctx.sources:
            prompts = [name_windows(p, ctx) for p in prompts]
        return await self._inner.render_cmpl_async(prompts, *args, **kwargs)

    def render_messages(self, messages, params):
        conv, prompt = self._inner.render_messages(messages, params)
        check_items(prompt, CURRENT.get() or RequestContext())
        return conv, prompt

    async def render_chat_async(self, conversations, chat_params, tok_params=None, *, prompt_extras=None,
                                skip_mm_cache: bool = False):
        """vLLM's ``render_chat_async`` in its own steps (parse and template, tokenize, process), with
        the items checked after parsing, and the prompts an encoder laid out spliced instead of
        processed. The call's decode budget is given back once the prompts are processed."""
        ctx = CURRENT.get() or RequestContext()
        arrival = time.time()
        if tok_params is None:
            tok_params = self._inner.default_chat_tok_params
        try:
            rendered = await asyncio.gather(*(self.render_messages_async(m, chat_params) for m in conversations))
            convs, prompts = [c for c, _ in rendered], [p for _, p in rendered]
            if not ctx.layouts:
                extras = {**(prompt_extras or {}), "media_io_kwargs": chat_params.media_io_kwargs or {}}
                inputs = await self._inner.render_cmpl_async(prompts, tok_params, prompt_extras=extras,
                                                             skip_mm_cache=skip_mm_cache)
                for engine_input in inputs:
                    engine_input["arrival_time"] = arrival  # as vLLM stamps a chat: before its media loaded
                return convs, inputs
            inputs = []
            for prompt in prompts:
                (tok,) = await self._inner.tokenize_prompts_async([prompt], tok_params)
                engine_input = _lay_out(tok, ctx, self._metadata_fields)
                if (salt := (prompt_extras or {}).get("cache_salt")) is not None:
                    engine_input["cache_salt"] = salt
                engine_input["arrival_time"] = arrival
                inputs.append(engine_input)
            ctx.laid_out += 1
            return convs, inputs
        finally:
            if ctx.media is not None:
                ctx.media.release()


LAID_OUT_MODALITIES = ("image", "audio", "video")
"""Modalities whose items an encoder processes and the LM lays out from its metadata."""


def _lay_out(tok_prompt: dict, ctx: RequestContext, metadata_fields: dict[str, set[str]] | None = None) -> dict:
    """vLLM's tokenized chat prompt (placeholders not expanded; uuid-only items) as an
    engine input whose items are laid out from the encoders' metadata. ``metadata_fields``:
    per modality, the processed fields each item must bring (Qwen-VL's grid, Qwen2-Audio's
    token count)."""

    data = dict(tok_prompt.get("multi_modal_data") or {})
    uuids = dict(tok_prompt.get("multi_modal_uuids") or {})
    per = {m: (data.pop(m, None) or [], list(uuids.pop(m, None) or [])) for m in LAID_OUT_MODALITIES}
    per = {m: v for m, v in per.items() if v[0] or v[1]}
    if data or any(v for v in uuids.values()):
        raise BadInput(f"only {', '.join(LAID_OUT_MODALITIES)} items can come from an encoder; got "
                       f"{sorted(set(data) | set(uuids))}")
    for modality, (values, idents) in list(per.items()):
        # Items named by their bytes (EncodedElsewhere: the Messages API's images) are the
        # uuid-only items they stand for.
        if values and not idents:
            idents = [None] * len(values)
        if len(idents) == len(values):
            idents = [v.identifier if isinstance(v, EncodedElsewhere) else u for v, u in zip(values, idents)]
            values = [None if isinstance(v, EncodedElsewhere) else v for v in values]
        per[modality] = (values, idents)
    layouts: dict[str, list[ItemLayout]] = {}
    for modality, (values, idents) in per.items():
        if any(v is not None for v in values) or len(idents) != len(values):
            raise BadInput(f"a request with encoder items may not carry {modality} data as well")
        layouts[modality] = []
        for ident in idents:
            lay = ctx.layouts.get(ident) if ident else None
            if lay is None:
                raise BadInput(f"{modality} {str(ident)[:16]!r}... has no encoder metadata")
            layouts[modality].append(lay)
    try:
        ids, positions = splice_modalities(list(tok_prompt["prompt_token_ids"]), layouts)
    except ValueError as e:  # LayoutError: fewer placeholders than items (more are text, as in vLLM)
        raise BadInput(str(e)) from None
    items, idents, ranges = {}, {}, {}
    for modality, lays in layouts.items():
        idents[modality] = per[modality][1]
        ranges[modality] = [
            PlaceholderRange(offset=off, length=length,
                             is_embed=torch.frombuffer(bytearray(lay.is_embed), dtype=torch.uint8).bool()
                             if lay.is_embed else None)
            for (off, length), lay in zip(positions[modality], lays)]
        # Families that declare placeholder metadata (Qwen-VL: the grid M-RoPE positions come from;
        # Qwen2-Audio: each clip's token count) get their metadata-only item; the embeddings
        # themselves arrive through the connector.
        items[modality] = [ctx.mm_kwargs.get(ident) for ident in idents[modality]]
        needed = (metadata_fields or {}).get(modality, set())
        for ident, item in zip(idents[modality], items[modality]):
            missing = set(needed) - set(item or ())
            if missing:  # the engine would fail the whole batch on it: refused here instead
                raise BadInput(f"{modality} {str(ident)[:16]!r}... came without {sorted(missing)} from its "
                               "encoder (an encoder older than this LM?)")
    return mm_input(ids, items, idents, ranges, prompt=tok_prompt.get("prompt"))


class ConsumerEngine:
    """The LM's ``AsyncLLM`` as vLLM's serving classes see it: ``renderer`` is the
    ``LaidOutRenderer``; ``generate`` adds the current request's ``ec_transfer_params``
    and records its outputs in the ``RequestContext``. Every other attribute is the
    engine's."""

    encoder_decoder = False
    """An encoder-decoder model's engine: each engine call names only its own speech window's source."""

    def __init__(self, engine) -> None:
        self._engine = engine

        resolver = PlaceholderMetadataResolver(engine.model_config)
        self.encoder_decoder = bool(engine.model_config.is_encoder_decoder)
        self.renderer = LaidOutRenderer(engine.renderer, {m: set(resolver.fields_for(m)) for m in LAID_OUT_MODALITIES},
                                        self.encoder_decoder)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        ctx = CURRENT.get()
        if self.encoder_decoder and ctx is not None and ctx.sources:
            # vLLM's speech-to-text serving makes one engine call per window with one SamplingParams
            # object: each call's window source goes on a copy of its own.
            sampling_params = sampling_params.clone()
        extra = dict(sampling_params.extra_args or {})
        # Only the gateway's items name encoders: a client's own ec_transfer_params (a request field
        # vLLM forwards, or vllm_xargs) would make the LM dial what the caller chose.
        extra.pop("ec_transfer_params", None)
        if ctx is not None and ctx.kv.phase and ctx.engine_calls:
            # Beam search (one call per beam per step) or a Responses loop: the prefill LM would keep
            # blocks for every call and the decode LM would load one call's KV into another.
            ctx.failure = BadInput(
                "this request makes more than one engine call (beam search, or a Responses request that "
                "loops): it cannot be split between a prefill and a decode LM; the gateway sends such a "
                "request to one LM whole")
            raise ctx.failure
        # Likewise the kv params (they name the prefill engine a decode LM dials): only the gateway's
        # KVHandoff sets them.
        handoff.set_sampling(ctx.kv if ctx is not None else handoff.Handoff(), sampling_params, extra)
        if ctx is not None and ctx.sources:
            sources = ctx.sources
            if self.encoder_decoder:
                # One engine call per speech window: each names the source of its own window only (vLLM
                # encodes a window no encoder cut, or one a language detection call reads, here).
                named = mm_hashes(prompt)
                sources = {i: s for i, s in ctx.sources.items() if i in named}
            if sources:
                extra["ec_transfer_params"] = ECTransferParams(sources).to_dict()
        sampling_params.extra_args = extra or None
        # vLLM publishes the session id on each KV block the request stores: it is the gateway's prefix key
        # (the LM's holdings), never a client's (a request field, a header or vllm_xargs).
        kwargs["session_id"] = ctx.prefix_key if ctx is not None else None
        gen = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        if ctx is not None:
            ctx.submitted = True
            ctx.engine_calls += 1
        if ctx is None:
            return gen

        return _recorded(gen, ctx, request_id, delta=sampling_params.output_kind == RequestOutputKind.DELTA)


async def _recorded(gen, ctx: RequestContext, request_id: str, delta: bool):
    try:
        async for out in gen:
            ctx.final = out
            failed = [c for c in out.outputs if c.finish_reason == "error"]
            info = ConsumerFinished.from_dict(out.ec_transfer_params) if failed else None
            if failed and ctx.kv.phase == handoff.DECODE and not (info.error or info.failed_endpoints):
                # vLLM fails a request whose KV it could not load (kv_load_failure_policy "fail"). An item
                # this engine needed and could not read fails it the same way, and vLLM drops the
                # connector's report then, so the two look alike here unless the report names the item;
                # a decode LM needs an item only when the prompt's last token falls inside it, so the KV
                # is blamed (the retry, without that prefill LM, re-encodes every item anyway).
                remote = (ctx.kv.params or {}).get("remote_engine_id", "?")
                ctx.failure = PrefillKVUnavailable(
                    f"request {request_id}: the prompt's KV could not be loaded from the prefill LM "
                    f"(engine {remote}): its NIXL handshake or read failed (the service's log has vLLM's reason)")
                raise ctx.failure
            if failed and ctx.sources:
                # vLLM drops the connector's ec_transfer_params when it fails a request
                # (take_unavailable_requests): without them every encoder the request used is named.
                named = list(info.failed_endpoints) or ECTransferParams(ctx.sources).endpoints()
                ctx.failure = EncoderUnavailable(
                    info.error or f"request {request_id}: an embedding from encoder(s) {', '.join(named)} "
                    "could not be obtained", named)
                raise ctx.failure
            if out.ec_transfer_params is not None:
                # One report per engine call: an API call that makes several (a speech upload's windows)
                # reports them together.
                ctx.ec_report = out.ec_transfer_params if ctx.ec_report is None else \
                    ConsumerFinished.from_dict(ctx.ec_report).then(ConsumerFinished.from_dict(out.ec_transfer_params)).to_dict()
                out.ec_transfer_params = None  # vLLM would copy it into answers (Responses, Messages)
            if (report := handoff.take_report(out)) is not None:
                ctx.kv_report = report
            if any(c.token_ids for c in out.outputs):
                ctx.last_token_at = time.perf_counter()
                ctx.first_token_at = ctx.first_token_at or ctx.last_token_at
            for c in out.outputs:
                ctx.tokens[c.index] = (ctx.tokens.get(c.index, 0) if delta else 0) + len(c.token_ids)
            yield out
    finally:
        await gen.aclose()


@dataclass
class Frontend:
    chat: Any
    completion: Any
    models: Any
    engine: ConsumerEngine
    app: Any = None
    """vLLM's own HTTP application over ``engine`` (``services.lm.vllm_app``): every other route."""


def serve_args(cfg: FrontendConfig, model: str):
    """``cfg`` parsed by ``vllm serve``'s own argument parser (every other flag at its default)."""
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cfg.serve_argv(model))
    validate_parsed_serve_args(args)
    return args


async def build_frontend(engine, cfg: FrontendConfig, model: str) -> Frontend:
    """vLLM's chat and completion serving objects over ``engine`` (wrapped in a
    ``ConsumerEngine``), built as vLLM's ``init_app_state`` builds them."""

    args = serve_args(cfg, model)
    client = ConsumerEngine(engine)
    names = args.served_model_name or [args.model]
    models = OpenAIServingModels(engine_client=client,
                                 base_model_paths=[BaseModelPath(name=n, model_path=args.model) for n in names])
    await models.init_static_loras()
    template = load_chat_template(args.chat_template)
    template_kwargs = resolve_default_chat_template_kwargs(args)
    reasoning = engine.vllm_config.structured_outputs_config.reasoning_parser or None
    renderer = OnlineRenderer(
        model_config=client.model_config, renderer=client.renderer, request_logger=None,
        chat_template=template, chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        trust_request_mm_kwargs=args.trust_request_mm_kwargs,
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser, tool_strict_level=args.tool_strict_level,
        reasoning_parser=reasoning, default_chat_template_kwargs=template_kwargs,
        log_error_stack=args.log_error_stack)
    chat = OpenAIServingChat(
        engine_client=client, models=models, response_role=args.response_role, online_renderer=renderer,
        request_logger=None, chat_template=template,
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=template_kwargs,
        trust_request_chat_template=args.trust_request_chat_template,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser, tool_strict_level=args.tool_strict_level,
        reasoning_parser=reasoning, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage)
    completion = OpenAIServingCompletion(
        client, models, online_renderer=renderer, request_logger=None,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage)
    app = await build_vllm_app(client, args)
    return Frontend(chat=chat, completion=completion, models=models, engine=client, app=app)


def validation_error(frontend: Frontend, exc) -> tuple[int, bytes]:
    """A pydantic ValidationError of a request body as vLLM's server answers it (400, the
    errors listed as its validation handler lists them: its private ``_format_error``)."""
    errors = exc.errors()
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n" + "".join(
        f"  {_format_error(e)}\n" for e in errors[:10])
    err = frontend.chat.create_error_response(message.rstrip())
    return err.error.code, json.dumps(err.model_dump(), ensure_ascii=False, allow_nan=False,
                                      separators=(",", ":")).encode()  # as vLLM's JSONResponse
