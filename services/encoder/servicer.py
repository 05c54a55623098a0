"""EncoderService handlers: Encode and GetInfo.

Encode processes the media once in vLLM's frontend (HF processor), streams each
item's metadata right away, then runs the engine (encoder only) and streams
"encoded" per item once the output sits in the outbound pool, which the
connector inside the engine process owns.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import torch
from prometheus_client import Counter, Histogram
from vllm import SamplingParams
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
from vllm.exceptions import VLLMClientError
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem
from vllm.multimodal.media.audio import AudioMediaIO

from ectransfer import tensors
from ectransfer.connector.metadata import MAX_READERS, ProducerFinished, ProducerParams
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from services.common.engine import tokenize_async
from services.common.errors import BadInput, Deadline, EPDError
from services.common.layout import ItemLayout, item_layouts, placeholder_ranges
from services.common.media import MediaDecoder, check_namespace, content_id, window_id
from services.common.media_checks import VideoHeader
from services.common.vllm_media import decode_audio, frames_sampled_by, processor_audio_rate, video_io_for
from services.encoder.signals import LOAD

logger = logging.getLogger(__name__)

ENCODE_REQUESTS = Counter("epd_encoder_requests_total", "Encode calls", ["status"])
ENCODER_RUNS = Counter("epd_encoder_vision_runs_total", "Items the vision encoder actually ran on")
ITEMS = Counter("epd_encoder_items_total", "Items requested through Encode")
ENCODE_SECONDS = Histogram("epd_encoder_encode_seconds", "Encode call duration",
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, engine, info: encoder_pb2.EncoderInfo, placeholders: dict[str, Callable[[int], str]],
                 embed_widths: dict[str, int],
                 dtype: int, timeout_s: float, decoder: MediaDecoder, layouts: bool = True,
                 transfer=None, speech=None) -> None:
        """``placeholders``: per modality this encoder serves ("image", "audio"), the model's prompt
        placeholder for its i-th item (1-based; vLLM's ``get_placeholder_str``); ``embed_widths``:
        per modality, the width of one embedding row (key "": the default, the LM's hidden size); ``layouts``: send each item's prompt layout (False: this model's
        layouts depend on the prompt around the item, see ``vllm_glue.layouts_context_free``; LMs use
        their processor); ``transfer``: a ``TransferServiceStub`` on this encoder's own Transfer server
        (its engine's outbound store), which ``Holdings`` asks; ``speech``: an encoder-decoder model's
        upload reader (``services.encoder.speech.SpeechWindows``), for Encode calls carrying an upload."""
        self.engine = engine
        self.transfer = transfer
        self.speech = speech
        self.decoder = decoder
        mm = engine.model_config.multimodal_config
        self.limits = {m: mm.get_limit_per_prompt(m) for m in placeholders}
        self.info = info
        self.placeholders = placeholders
        self.embed_widths = embed_widths
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._originals: dict[tuple[str, int], list[int]] = {}  # the encode prompt for n items, tokenized
        self.send_layouts = layouts
        self.encoder_decoder = engine.model_config.is_encoder_decoder  # Whisper-class: no decoder prompt to lay out
        self._warned = False
        self._resolver = None  # vLLM's PlaceholderMetadataResolver, made on first use
        self._loaders: dict[str, Callable[[bytes], Any]] = {}  # vLLM's media decoders, made on first use
        self._sampled: dict[str, Callable[[VideoHeader], int]] = {}  # video: frames its loader decodes per clip
        self._rates: dict[str, int | None] = {}  # audio: the rate the processor resamples it to

    def _metadata_kwargs(self, feat) -> str:
        """The item's processed inputs the LM needs without the media (the fields this
        family's data parser declares as placeholder metadata, and keep_on_cpu ones, e.g.
        Qwen-VL's image_grid_thw; Qwen2-Audio's audio_num_tokens, which vLLM reads from the
        item's placeholder), serialized as vLLM's scale-out front end does; "" for families
        that declare none (Idefics3, LLaVA, Gemma 3)."""

        if self._resolver is None:
            self._resolver = PlaceholderMetadataResolver(self.engine.model_config)
        declared = self._resolver.fields_for(feat.modality)
        if not declared:
            return ""
        from_placeholder = {"audio_num_tokens"} & declared  # as vLLM's collect_ec_item_metadata reads it
        if feat.data is None and declared - from_placeholder:  # the service turns the processor cache off for these
            raise EPDError(f"item {feat.identifier[:16]}...: the processor returned no data for it, so its "
                           f"metadata ({sorted(declared)}) cannot be sent; is mm_processor_cache_gb 0?")
        kept = {k: e for k, e in (feat.data or {}).items() if e.field.keep_on_cpu or k in declared}
        if from_placeholder and "audio_num_tokens" not in kept:
            kept["audio_num_tokens"] = MultiModalFieldElem(data=torch.tensor(feat.mm_position.get_num_embeds()),
                                                           field=MultiModalBatchedField(keep_on_cpu=True))
        return encode_mm_kwargs_item(MultiModalKwargsItem(kept)) if kept else ""

    async def GetInfo(self, request, context):
        return self.info

    async def Holdings(self, request, context):
        """What this encoder's outbound store holds (host tier included), as its engine's Transfer server
        answers it: the store lives in the engine process."""
        if self.transfer is None:
            raise EPDError("this encoder has no Transfer server to ask")
        try:
            return await self.transfer.Holdings(request, timeout=10)
        except grpc.aio.AioRpcError as e:
            raise EPDError(f"the engine's Transfer server did not answer Holdings ({e.code().name})") from None

    async def _layouts(self, modality: str, n: int, processed: list[int], features) -> list[ItemLayout] | None:
        """Each item's prompt expansion, for the LM to lay out its prompt without
        the image processor; None (the LM then runs its processor) if this
        model's processor does not simply replace each placeholder."""
        if self.encoder_decoder:  # the LM builds its decoder prompt itself; the audio sits in the encoder's
            return None
        if not self.send_layouts:
            if not self._warned:
                self._warned = True
                logger.warning("this model's processor rewrites the prompt around each image; LMs will run their "
                               "own image processor to lay out prompts")
            return None
        original = self._originals.get((modality, n))
        if original is None:
            original = self._originals[modality, n] = await tokenize_async(self.engine.renderer,
                                                                           self._prompt(modality, n))
        layouts = item_layouts(original, processed, placeholder_ranges(features))
        if layouts is None and not self._warned:
            self._warned = True
            logger.warning("this model's processor does not replace each %s placeholder in place; LMs will "
                           "run their own processor to lay out prompts", modality)
        return layouts

    def _loader(self, modality: str) -> Callable[[bytes], Any]:
        """vLLM's own decoder for ``modality``, set up as its chat front end sets it up for
        ``vllm serve`` (``MediaConnector.fetch_audio`` / ``fetch_video``: the model's
        ``media_io_kwargs``, the video backend its video processor asks for), so the processor
        here sees what it would see there."""
        if modality not in self._loaders:
            kwargs = self.engine.model_config.multimodal_config.media_io_kwargs or {}
            if modality == "audio":
                self._loaders[modality] = AudioMediaIO(**kwargs.get("audio", {})).load_bytes
            else:
                video_io = video_io_for(self.engine.model_config, kwargs)
                self._loaders[modality] = video_io.load_bytes
                self._sampled[modality] = frames_sampled_by(video_io)
        return self._loaders[modality]

    def _audio_rate(self) -> int | None:
        """The rate this model's processor resamples audio to (read once), for the audio decode charge."""
        if "audio" not in self._rates:
            self._rates["audio"] = processor_audio_rate(self.engine.renderer)
        return self._rates["audio"]

    def _prompt(self, modality: str, n: int) -> str:
        """The encode prompt: the model's placeholder for each of ``n`` items, in order (numbered where
        the model numbers them, e.g. Qwen2-Audio's "Audio 1: ...")."""
        return "".join(self.placeholders[modality](i + 1) for i in range(n))

    async def Encode(self, request, context):
        t0 = time.perf_counter()
        status = "error"

        def record(outcome: str) -> None:
            ENCODE_REQUESTS.labels(outcome).inc()
            ENCODE_SECONDS.observe(time.perf_counter() - t0)

        rid = request.request_id or uuid.uuid4().hex
        pending = LOAD.admit(len(request.items))  # the queue depth, until they are encoded (a scaling signal)
        try:
            modality, idents = self._checked(request)
            # This call's claim on the copies its items get in the outbound pool (ectransfer.outbound):
            # the LM names it to read, ack or cancel them; an aborted encode drops it.
            # One claim per LM that reads the items (EncodeRequest.readers: the prefill and the decode
            # LM of an E -> P -> D request), each settled by its own reader.
            claim, *more = (secrets.token_hex(16) for _ in range(request.readers or 1))
            if request.items[0].upload_content_type:
                async for event in self._upload(request, rid, claim, more, t0):
                    if event is None:  # every window is encoded: counted before the last events go out
                        pending.done()
                        status = "ok"
                        record(status)
                        continue
                    yield event
                return
            engine_req, params = await self._engine_request(request, rid, modality, idents, claim, tuple(more))
            features = engine_req.mm_features or []
            layouts = await self._layouts(modality, len(idents), engine_req.prompt_token_ids, features)
            for index, feat in enumerate(features):
                yield encoder_pb2.EncodeEvent(metadata=self._item_metadata(index, feat, layouts, claim, more))
            pending.started()  # its wait in front of the engine ends (a scaling signal)
            runs = await self._encode(engine_req, params, rid)
            pending.done()
            encode_ms = (time.perf_counter() - t0) * 1e3
            # Counted and logged before the last events go out: a caller that has
            # every ItemEncoded may close the stream before this generator resumes.
            status = "ok"
            record(status)
            logger.info("request %s: encoded %d item(s) in %.1f ms (%d vision run(s))",
                        rid, len(features), encode_ms, runs)
            for index, feat in enumerate(features):
                yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(
                    identifier=feat.identifier, index=index, encode_ms=encode_ms))
        except TimeoutError:
            await self.engine.abort(rid)
            raise Deadline(f"request {rid}: encode took longer than {self.timeout_s}s") from None
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            raise
        finally:
            pending.done()
            if status != "ok":  # an ok one was counted before its last events
                record(status)

    def _checked(self, request) -> tuple[str, list[str]]:
        """The call's modality and its items' identifiers, or BadInput. The identifier is vLLM's mm_hash on
        both engines: it names what the bytes are, so it is always computed here, never taken from the
        caller (who could name another image's embedding). It is computed in the request's namespace (its
        tenant's, from the gateway), so the engine's processor and encoder caches and the outbound store
        keep each tenant's items apart."""
        if not request.items:
            raise BadInput("Encode needs at least one item")
        readers = request.readers or 1
        if not 1 <= readers <= MAX_READERS:
            raise BadInput(f"readers must be 1 to {MAX_READERS}, got {readers}")
        modality = request.items[0].modality or "image"
        for i, item in enumerate(request.items):
            if (item.modality or "image") not in self.placeholders:
                raise BadInput(f"item {i}: modality {item.modality!r} is not encoded here (this model: "
                               f"{', '.join(self.placeholders)})")
            if (item.modality or "image") != modality:
                raise BadInput("the items of one Encode call must share a modality (send one call per "
                               "modality)")
        namespace = check_namespace(request.namespace)
        if any(item.upload_content_type for item in request.items):
            if self.speech is None:
                raise BadInput("this encoder cuts no speech uploads (its model is no encoder-decoder speech model)")
            if len(request.items) != 1 or modality != "audio":
                raise BadInput("a speech upload is one audio item of its own Encode call")
        idents = [content_id(item.data, namespace) for item in request.items]
        for i, (item, ident) in enumerate(zip(request.items, idents)):
            if item.identifier and item.identifier != ident:
                raise BadInput(f"item {i}: identifier {item.identifier[:16]!r}... is not the content hash of "
                               f"its bytes in the request's namespace")
        return modality, idents

    async def _engine_request(self, request, rid: str, modality: str, idents: list[str], claim: str,
                              more: tuple[str, ...]):
        """The items decoded (under the decoder's budget lease, given back once the processor's tensors
        replace them) and processed by vLLM's processor into the engine's request, and its sampling
        params (the claims). Raises BadInput for what the processor refuses."""
        datas = [item.data for item in request.items]
        if modality == "image":
            media, lease = await self.decoder.decode(datas, self.limits[modality], rid)
        elif modality == "audio":  # charged its decode's peak and the processor's resample (decode_charge)
            media, lease = await decode_audio(self.decoder, datas, self.limits[modality], self._loader(modality),
                                              self._audio_rate(), rid)
        else:
            loader = self._loader(modality)
            media, lease = await self.decoder.decode_media(modality, datas, self.limits[modality], loader, rid,
                                                           self._sampled.get(modality))
        ITEMS.inc(len(media))
        prompt = {
            "prompt": self._prompt(modality, len(media)),
            "multi_modal_data": {modality: media},
            "multi_modal_uuids": {modality: idents},
        }
        if self.encoder_decoder:  # vLLM's explicit prompt, as Whisper's get_generation_prompt builds it
            prompt = {"encoder_prompt": prompt, "decoder_prompt": ""}
        params = SamplingParams(max_tokens=1,
                                extra_args={"ec_transfer_params": ProducerParams(claim, more).to_dict()})
        try:
            engine_req = await self.engine.input_processor.process_inputs_async(
                rid, prompt, params, supported_tasks=await self.engine.get_supported_tasks())
        except (ValueError, VLLMClientError) as e:  # VLLMValidationError is no ValueError in vLLM 0.32
            raise BadInput(f"input rejected by the encoder's processor: {e}") from None
        finally:
            del media, prompt  # the processor's tensors replace the decoded media
            lease.release()
        return engine_req, params

    async def _upload(self, request, rid: str, claim: str, more: list[str], t0: float):
        """An encoder-decoder model's speech upload (``services.encoder.speech``): one metadata event per
        window as vLLM's serving cuts it, every window encoded (one engine request each: the model takes
        one clip per prompt), then None (the caller counts the call) and one encoded event per window. An
        upload vLLM's app would refuse gets one metadata event with no windows: the LM answers it."""
        item = request.items[0]
        audio = await self.speech.file_part(item.data, item.upload_content_type)
        windows, lease = (None, None) if audio is None else await self.speech.read(audio, self.decoder, rid)
        del audio
        try:
            if windows is None or not windows.samples:
                yield encoder_pb2.EncodeEvent(metadata=encoder_pb2.ItemMetadata(index=0, modality="audio"))
                yield None
                return
            n = len(windows.samples)
            ITEMS.inc(n)
            params = SamplingParams(max_tokens=1,
                                    extra_args={"ec_transfer_params": ProducerParams(claim, tuple(more)).to_dict()})
            engine_reqs = []
            async for w, engine_req in self._window_requests(windows, request.namespace, rid, params):
                engine_reqs.append(engine_req)
                md = self._item_metadata(0, engine_req.mm_features[0], None, claim, more)
                md.window, md.windows = w, n
                yield encoder_pb2.EncodeEvent(metadata=md)
        finally:
            if lease is not None:
                lease.release()  # the processor's features replace the samples
        done: list[str] = []
        try:
            runs = 0
            for engine_req in engine_reqs:  # one at a time: each its own engine request, in window order
                runs += await self._encode(engine_req, params, engine_req.request_id)
                done.append(engine_req.request_id)
        except BaseException:
            for engine_req in engine_reqs:
                if engine_req.request_id not in done:
                    await self.engine.abort(engine_req.request_id)
            raise
        encode_ms = (time.perf_counter() - t0) * 1e3
        yield None
        logger.info("request %s: encoded an upload's %d window(s) in %.1f ms (%d encoder run(s))",
                    rid, n, encode_ms, runs)
        for engine_req in engine_reqs:
            yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(
                identifier=engine_req.mm_features[0].identifier, index=0, encode_ms=encode_ms))

    async def _window_requests(self, windows, namespace: str, rid: str, params):
        """Each window of an upload as its engine request (vLLM's explicit encoder-decoder prompt, the window
        named by its samples), in order, with its index; BadInput for one the processor refuses."""
        supported = await self.engine.get_supported_tasks()
        for w, samples in enumerate(windows.samples):
            ident = window_id(samples, windows.rate, namespace)
            prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (samples, windows.rate)},
                                         "multi_modal_uuids": {"audio": [ident]}},
                      "decoder_prompt": ""}
            try:
                yield w, await self.engine.input_processor.process_inputs_async(
                    f"{rid}-w{w}", prompt, params, supported_tasks=supported)
            except (ValueError, VLLMClientError) as e:
                raise BadInput(f"window {w} of the upload rejected by the encoder's processor: {e}") from None

    def _item_metadata(self, index: int, feat, layouts, claim: str, more: list[str]) -> encoder_pb2.ItemMetadata:
        """One item's metadata: its ``ItemSource`` (where and what its embedding is, and its prompt layout)."""
        source = transfer_pb2.ItemSource(
            num_embeds=feat.mm_position.get_num_embeds(),
            embed_width=self.embed_widths.get(feat.modality, self.embed_widths[""]),
            dtype=self.dtype, transfer_endpoint=self.info.transfer_endpoint,
            encoder_id=self.info.encoder_id, claim=claim, extra_claims=more,
            mm_kwargs=self._metadata_kwargs(feat))
        if layouts is not None:
            lay = layouts[index]
            source.placeholder_token_ids.extend(lay.placeholder)
            source.prompt_token_ids.extend(lay.tokens)
            source.is_embed = lay.is_embed
        return encoder_pb2.ItemMetadata(identifier=feat.identifier, index=index, modality=feat.modality,
                                        source=source)

    async def _encode(self, engine_req, params, rid: str) -> int:
        """Runs the engine's request to its end (within ``timeout_s``: TimeoutError); returns its vision
        encoder runs (0: every item was in the encoder cache)."""
        final = None
        async with asyncio.timeout(self.timeout_s):
            with LOAD.running():  # the engine's busy seconds (a scaling signal)
                async for out in self.engine.generate(engine_req, params, rid):
                    final = out
        if final is None or not final.finished:
            raise EPDError(f"request {rid}: the encoder engine returned no result")
        if final.outputs and final.outputs[0].finish_reason not in (None, "stop", "length"):
            raise EPDError(f"request {rid}: encoding failed ({final.outputs[0].finish_reason})")
        runs = ProducerFinished.from_dict(final.ec_transfer_params).encoder_runs
        ENCODER_RUNS.inc(runs)
        return runs


def dtype_enum(name: str) -> int:
    return tensors.dtype_to_proto(tensors.dtype_from_name(name))
