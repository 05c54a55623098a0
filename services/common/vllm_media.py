"""vLLM's media loaders as the encoder and the LM use them (the gateway never imports this: it
pulls in vLLM). Imported by the encoder's and the LM's modules, which the command loads after
``configure_process_env`` (``services.cli.service_module``)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from vllm.multimodal.video import get_video_loader_backend_for_processor
from vllm.multimodal.video_decoders import resolve_video_backend_kwargs
from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata
from vllm.transformers_utils.processor import get_video_processor_cls_name

from services.common.budget import DecodeLease
from services.common.decode_charge import AudioRefused, chat_charge
from services.common.errors import BadInput
from services.common.media import MediaDecoder
from services.common.media_checks import MAX_SAMPLED_FRAMES, VideoHeader

logger = logging.getLogger(__name__)


def video_io_for(model_config, media_io_kwargs: dict[str, dict[str, Any]] | None = None):
    """vLLM's ``VideoMediaIO`` for ``model_config`` set up as its chat front end sets it up for
    ``vllm serve`` (``MediaConnector.fetch_video``: the model's ``media_io_kwargs``, the video
    backend its video processor asks for)."""

    kwargs = media_io_kwargs if media_io_kwargs is not None else (
        model_config.multimodal_config.media_io_kwargs or {})
    video_kw = dict(kwargs.get("video", {}))
    if "video_backend" not in video_kw and (backend := get_video_loader_backend_for_processor(
            get_video_processor_cls_name(model_config))):
        video_kw["video_backend"] = backend
    image_io = ImageMediaIO(**({"image_mode": "RGB"} | kwargs.get("image", {})))
    return VideoMediaIO(image_io, **video_kw)


def frames_sampled_by(video_io) -> Callable[[VideoHeader], int]:
    """How many frames vLLM's video loader behind ``video_io`` (a ``VideoMediaIO``) will decode from
    a clip with this header, computed with the loader's own sampling rule and arguments (Qwen-VL's
    loaders sample by fps, up to 768 frames; the default one ``num_frames``), so the decode budget
    is charged what the decode allocates. Falls back to ``min(frames, MAX_SAMPLED_FRAMES)``."""


    loader = video_io.video_loader
    args = {name: p.default for name, p in inspect.signature(loader.load_bytes).parameters.items()
            if p.default is not inspect.Parameter.empty}
    args.update(video_io.kwargs, num_frames=video_io.num_frames)
    known = ("num_frames", "fps", "max_duration", "frame_recovery", "backend")

    def count(header: VideoHeader) -> int:
        try:
            source = loader._prepare_source(VideoSourceMetadata(header.frames, header.fps, header.seconds))
            target = VideoTargetMetadata(num_frames=args.get("num_frames", -1), fps=args.get("fps", -1),
                                         max_duration=args.get("max_duration", 300))
            sampling, _ = resolve_video_backend_kwargs(args.get("backend", "opencv"),
                                                       {k: v for k, v in args.items() if k not in known})
            return len(loader.compute_frames_index_to_sample(source=source, target=target, **sampling))
        except Exception:  # a loader vLLM changed: charge the most any loader takes
            logger.warning("cannot compute the frames %s samples; charging up to %d", loader.__name__,
                           MAX_SAMPLED_FRAMES, exc_info=True)
            return min(header.frames, MAX_SAMPLED_FRAMES)

    return count



def processor_audio_rate(renderer) -> int | None:
    """The rate vLLM's processor behind ``renderer`` (an engine's) resamples audio to (its data parser's
    ``target_sr``: the model's feature extractor's), or None for a model that takes no audio (or no renderer)."""
    if renderer is None:
        return None
    try:
        rate = renderer.get_mm_processor().data_parser.audio_resampler.target_sr
    except Exception:  # no multimodal processor, or a vLLM that moved it: the charge assumes none
        logger.info("cannot read the rate this model's processor resamples audio to", exc_info=True)
        return None
    return int(rate) if rate else None


def audio_charges(decoder: MediaDecoder, datas: list[bytes], limit: int, target_rate: int | None) -> int:
    """Header checks of one request's audio clips (``MediaDecoder.check_media``: their count, format and
    length) and the peak their decode and the processor's resample to ``target_rate`` hold together
    (``services.common.decode_charge.chat_charge``); blocking: run it on a decode thread. Raises BadInput
    naming the clip: vLLM's refusal from its header, or a decode the whole budget cannot hold."""
    import vllm.envs as envs

    decoder.check_media("audio", datas, limit)
    nbytes = 0
    for i, data in enumerate(datas):
        try:
            charge = chat_charge(data, target_rate, decoder.cfg.max_audio_seconds, envs.VLLM_MAX_AUDIO_DECODE_BYTES)
        except AudioRefused as e:
            raise BadInput(f"audio {i}: {e}") from None
        if (why := charge.refusal(decoder.budget.capacity, decoder.cfg.decode_budget_mib)) is not None:
            raise BadInput(f"audio {i}: {why}")
        nbytes += charge.nbytes
    if nbytes > decoder.budget.capacity:
        raise BadInput(f"the request's audio decodes to {nbytes >> 20} MiB at its peak, more than this service "
                       f"decodes at once ({decoder.cfg.decode_budget_mib:g} MiB, --decode-budget-mib)")
    return nbytes


async def decode_audio(decoder: MediaDecoder, datas: list[bytes], limit: int, loader: Callable[[bytes], Any],
                       target_rate: int | None, rid: str = "") -> tuple[list[Any], DecodeLease]:
    """As ``MediaDecoder.decode_media`` for audio, charged ``audio_charges`` (the decode's peak at the
    clips' own rates and the processor's resample) instead of the decoded samples alone. The caller
    releases the lease once vLLM's processor has made its features."""
    (nbytes,) = await decoder.run_all([functools.partial(audio_charges, decoder, datas, limit, target_rate)],
                                      "audio header")
    return await decoder.decode_under_budget(nbytes, "audio", rid,
                                             [functools.partial(_load_clip, i, data, loader)
                                              for i, data in enumerate(datas)])


def _load_clip(i: int, data: bytes, loader: Callable[[bytes], Any]) -> Any:
    try:
        return loader(data)
    except Exception as e:  # noqa: BLE001 - decoders raise many types for bad data
        raise BadInput(f"audio {i} could not be decoded: {e}") from None
