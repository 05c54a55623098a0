"""Media decoding and identity. The gateway reads media once; services decode
bytes they were handed and never download anything.

Services decode through one ``MediaDecoder`` each (``MediaConfig`` sets its
limits). Per request, before any pixel is decoded: at most ``max_images``
images, each a format of ``IMAGE_FORMATS`` whose header claims at most
``max_image_pixels`` (PIL opens lazily: ``.size`` comes from the header, so a
few KB of PNG that claim gigapixels are refused unread), and together at most
``max_request_pixels`` (all INVALID_ARGUMENT: retrying cannot help). Then the
request takes its decoded bytes from the service's ``ByteBudget``, waiting at
most ``decode_wait_s`` (else RESOURCE_EXHAUSTED), and the images are decoded
on a small thread pool (``epd-decode-*``), never on the event loop. The caller
holds the budget (a ``DecodeLease``) until the decoded images are handed on
and releases it; a failed or cancelled decode releases it itself.

Audio and video go the same way (``check_media``, ``decode_media``): at most
the engine's limit per prompt, each one of ``AUDIO_FORMATS`` /
``VIDEO_FORMATS`` (sniffed from its first bytes) whose header (soundfile for
audio, OpenCV's container reader for video; nothing decoded) says at most
``max_audio_seconds`` / ``max_video_seconds`` (video frames at most
``max_image_pixels``); the decoded size (float32 samples; the RGB frames vLLM
samples) is taken from the same budget, and vLLM's own ``AudioMediaIO`` /
``VideoMediaIO`` decodes the item, exactly as ``vllm serve`` decodes an
``audio_url`` / ``video_url``, so the processor sees the same input.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from services.common.budget import ByteBudget, DecodeLease
from services.common.errors import BadInput, MediaError, NoCapacity
from services.common.interruptible import DecodeThreads

logger = logging.getLogger(__name__)

MAX_IMAGE_PIXELS = 64_000_000  # decompression-bomb guard (PIL raises beyond 2x)
BYTES_PER_PIXEL = 4
"""Decoded bytes charged to the budget per pixel: the RGB result (3) plus a
share of the decoder's own frame (RGBA/palette sources are converted after
decoding). An estimate, on the high side."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Formats the gateway accepts (what OpenAI accepts, plus BMP; JPEG's plugin also opens MPO, the JPEG
variant some cameras write). Only these PIL plugins are tried, so exotic parsers (EPS runs Ghostscript)
are never reached. Every name must be a key of PIL's ``Image.OPEN``: Pillow tries them in order and
raises KeyError at one it does not know ("MPO" is none since Pillow 13), refusing every later format."""


AUDIO_FORMATS = ("WAV", "FLAC", "OGG", "MP3")
"""Audio formats accepted (OpenAI's ``input_audio`` takes wav and mp3); all are read by soundfile
(libsndfile), the decoder vLLM's ``AudioMediaIO`` falls back to when torchcodec is absent."""
MAX_AUDIO_SECONDS = 600.0  # vLLM's own default limit (VLLM_MAX_AUDIO_DECODE_DURATION_S)


def sniff_audio_format(data: bytes) -> str | None:
    """The ``AUDIO_FORMATS`` name ``data``'s signature (its first bytes) names, or None."""
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return "WAV"
    if data.startswith(b"fLaC"):
        return "FLAC"
    if data.startswith(b"OggS"):
        return "OGG"
    if data.startswith(b"ID3") or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"  # an ID3 tag, or an MPEG audio frame sync
    return None


def sniffed_format(data: bytes, modality: str) -> str:
    """The format ``data``'s first bytes name (``AUDIO_FORMATS`` / ``VIDEO_FORMATS``), or MediaError
    for an empty item or an unknown signature (a declared media type proves nothing)."""
    if not data:
        raise MediaError(f"{modality} is empty")
    sniff, formats = (sniff_audio_format, AUDIO_FORMATS) if modality == "audio" else (sniff_video_format,
                                                                                     VIDEO_FORMATS)
    sniffed = sniff(data)
    if sniffed is None:
        raise MediaError(f"{modality} is not a recognised {modality} file (first bytes: {data[:12].hex(' ')}); "
                         f"accepted: {', '.join(formats)}")
    return sniffed


def check_audio(data: bytes, max_seconds: float) -> tuple[str, float, int]:
    """Reads the clip's header only and returns (format, seconds, decoded bytes), or raises MediaError:
    empty, not one of ``AUDIO_FORMATS`` (sniffed, then parsed as that format), no frames, or longer
    than ``max_seconds``. The decoded bytes are float32 PCM for every frame and channel (what vLLM's
    decoder allocates). The gateway calls this for every clip before any service sees it."""
    sniffed = sniffed_format(data, "audio")
    try:
        import soundfile

        info = soundfile.info(io.BytesIO(data))
    except ImportError:
        raise MediaError("audio cannot be read here: the soundfile package is not installed") from None
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types for bad data
        raise MediaError(f"audio starts like {sniffed} but its header cannot be read ({e}); refused") from None
    if info.frames <= 0 or info.samplerate <= 0 or info.channels <= 0:
        raise MediaError(f"audio ({sniffed}) holds no samples")
    seconds = info.frames / info.samplerate
    if seconds > max_seconds:
        raise MediaError(f"audio is {seconds:.1f} s long, more than the {max_seconds:g} s allowed "
                         "(--max-audio-seconds); refused")
    return sniffed, seconds, info.frames * info.channels * 4


VIDEO_FORMATS = ("MP4", "WEBM", "AVI")
"""Video containers accepted (MP4 includes QuickTime MOV; WEBM includes Matroska), decoded by
vLLM's ``VideoMediaIO`` with its default ``opencv`` backend, as ``vllm serve`` decodes a
``video_url``."""
MAX_VIDEO_SECONDS = 600.0
MAX_VIDEO_FPS = 120.0
"""Highest frame rate accepted: a loader reads (grabs) every frame up to the last one it samples."""
MAX_VIDEO_FRAMES = 36_000
"""Most frames a video may hold (600 s at 60 fps): what a loader may have to read through."""
MAX_SAMPLED_FRAMES = 768
"""The most frames any of vLLM 0.32's video loaders samples from one clip (Qwen-VL's fps-driven
loaders cap at 768): the budget's charge when the loader's own sampling cannot be computed."""


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container header says (``check_video``); nothing decoded."""

    format: str
    frames: int
    fps: float
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    def decoded_bytes(self, sampled: int) -> int:
        """RGB bytes of ``sampled`` frames."""
        return sampled * self.width * self.height * 3


def sniff_video_format(data: bytes) -> str | None:
    """The ``VIDEO_FORMATS`` name ``data``'s signature names, or None."""
    if data[4:8] == b"ftyp":
        return "MP4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "WEBM"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    return None


def check_video(data: bytes, max_seconds: float, max_frame_pixels: int, *, max_fps: float = MAX_VIDEO_FPS,
                max_frames: int = MAX_VIDEO_FRAMES) -> VideoHeader:
    """Reads the video's container header (OpenCV opens it from memory, as vLLM's opencv backend
    does; no frame is decoded) and returns it, or raises MediaError: empty, not one of
    ``VIDEO_FORMATS``, unreadable, no frames, frames over ``max_frame_pixels``, longer than
    ``max_seconds``, faster than ``max_fps`` or more than ``max_frames`` frames (a loader reads
    through every frame up to the last it samples). Blocking (it parses the container): services
    call it off their event loop."""
    sniffed = sniffed_format(data, "video")
    try:
        import cv2
        import cv2.videoio_registry as vr
    except ImportError:
        raise MediaError("video cannot be read here: OpenCV (cv2) is not installed") from None
    api = next((b for b in vr.getStreamBufferedBackends() if vr.hasBackend(b)), None)
    try:
        buf = io.BytesIO(data)  # referenced until the capture is released (OpenCV reads it, holding no reference)
        cap = cv2.VideoCapture(buf, api, []) if api is not None else None
        if cap is None or not cap.isOpened():
            raise MediaError(f"video starts like {sniffed} but cannot be opened; refused")
        try:
            w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
            frames, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS)
        finally:
            cap.release()
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - OpenCV raises cv2.error and others for bad data
        raise MediaError(f"video starts like {sniffed} but its header cannot be read ({e}); refused") from None
    if frames <= 0 or w <= 0 or h <= 0 or fps <= 0:
        raise MediaError(f"video ({sniffed}) holds no readable frames")
    if w * h > max_frame_pixels:
        raise MediaError(f"video frames are {w}x{h}, more than {max_frame_pixels} pixels (--max-image-pixels); "
                         "refused")
    header = VideoHeader(sniffed, frames, fps, w, h)
    if header.seconds > max_seconds:
        raise MediaError(f"video is {header.seconds:.1f} s long, more than the {max_seconds:g} s allowed "
                         "(--max-video-seconds); refused")
    if fps > max_fps:
        raise MediaError(f"video runs at {fps:g} frames per second, more than the {max_fps:g} allowed "
                         "(--max-video-fps); refused")
    if frames > max_frames:
        raise MediaError(f"video holds {frames} frames, more than the {max_frames} allowed (--max-video-frames); "
                         "refused")
    return header


MAX_NAMESPACE_LEN = 128
"""The longest embedding namespace a service takes (UTF-8 bytes): a tenant's is its name (at most 64) and ``:``."""
_NAMESPACE_TAG = b"epd-embedding-namespace\0"


def content_id(data: bytes, namespace: str = "") -> str:
    """The identifier of a media item (64 hex digits), which vLLM uses verbatim as mm_hash on both
    engines and every cache of an item's processed input or embedding is keyed by: the SHA-256 of its
    bytes, or with an embedding ``namespace`` (a tenant's: the gateway's ``tenant_namespace``), the
    SHA-256 of a tag, the namespace's length and text, then the bytes.

    Computed by whoever holds the bytes and the request's namespace (the gateway, to route; the encoder,
    which never takes one from its caller; the LM, for the media it decodes itself and for bytes it is
    sent beside an identifier) and compared, never trusted.

    Why it separates tenants: the length prefix makes (namespace, bytes) -> message one-to-one, so two
    namespaces never give one identifier for any bytes, and the tag makes a namespaced message start
    with bytes no accepted media file starts with (each is sniffed by its signature), so no item of the
    empty namespace shares one either. Every cache keyed by identifier is then per namespace: the
    gateway's encoder affinity, the encoder's vLLM processor and encoder caches and its outbound store
    (one copy per identifier), the LM's processor cache, encoder cache and connector (``has_cache_item``,
    preallocation), and vLLM's prefix cache (mm hashes are block extra keys; ``cache_salt`` also salts a
    prompt's first block). What it costs: the same bytes sent by two tenants are processed, encoded,
    held and transferred once per tenant; within a tenant every reuse is as before. The empty namespace
    gives exactly the SHA-256 of the bytes."""
    if not namespace:
        return hashlib.sha256(data).hexdigest()
    ns = namespace.encode()
    h = hashlib.sha256(_NAMESPACE_TAG)
    h.update(len(ns).to_bytes(2, "big"))
    h.update(ns)
    h.update(data)
    return h.hexdigest()


def check_namespace(namespace: str) -> str:
    """``namespace`` as a request carried it, or BadInput when it is too long to be a tenant's."""
    if len(namespace.encode()) > MAX_NAMESPACE_LEN:
        raise BadInput(f"an embedding namespace is at most {MAX_NAMESPACE_LEN} bytes, got {len(namespace.encode())}")
    return namespace


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decodes an image fully (not lazily) to RGB, or raises BadInput. Only
    ``IMAGE_FORMATS`` are tried, and the header's size is checked against
    ``max_pixels`` before any pixel is decoded. Blocking and CPU-bound: services
    call it through ``MediaDecoder``, off their event loop."""
    if not data:
        raise BadInput("image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels decides
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                if img.width * img.height > max_pixels:
                    raise BadInput(f"image is {img.width}x{img.height}, more than {max_pixels} pixels")
                img.load()
                return img.convert("RGB")
    except BadInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadInput(f"image refused as a decompression bomb: {e}") from None
    except Image.UnidentifiedImageError:
        raise BadInput(f"image could not be decoded: not a recognised image file "
                       f"(accepted: {', '.join(IMAGE_FORMATS)})") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
        raise BadInput(f"image could not be decoded: {e}") from None


def check_image(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """Reads the image header only (PIL opens lazily; nothing is decoded) and returns (format, width,
    height), or raises MediaError for an unknown format or more than ``max_pixels`` pixels (the
    decompression-bomb guard: a few KB of PNG can claim gigapixels). The gateway calls this for every
    image, data: URL or fetched, before any service sees it."""
    if not data:
        raise MediaError("image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                fmt, (w, h) = img.format, img.size
    except Image.DecompressionBombError as e:
        raise MediaError(f"image refused as a decompression bomb ({e}; the limit here is {max_pixels} pixels, "
                         "--max-image-pixels)") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for data it cannot identify
        raise MediaError(f"image is not a recognised image file (accepted: {', '.join(IMAGE_FORMATS)})") from None
    if w * h > max_pixels:
        raise MediaError(f"image is {w}x{h} = {w * h} pixels, more than the {max_pixels} allowed "
                         "(--max-image-pixels; decompression-bomb guard); refused")
    return fmt, w, h


@dataclass
class MediaConfig:
    """Decoding limits of the service that decodes images: the encoder (the LM decodes
    none for the items an encoder laid out; an image it processes itself is vLLM's to
    decode, after the gateway's header checks). ``EncoderServiceConfig`` inherits it,
    so each field is one of its flags."""

    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Largest image in pixels, read from its header before decoding (decompression-bomb guard)."""
    max_request_pixels: int = 128_000_000
    """Most pixels in the images of one request together; more is INVALID_ARGUMENT."""
    decode_budget_mib: float = 1024.0
    """Decoded image bytes this service holds at once, over all requests (4 bytes per pixel are charged,
    from the header's size, until the decoded images are handed to vLLM's processor)."""
    decode_wait_s: float = 10.0
    """How long a request waits for room in the decode budget before RESOURCE_EXHAUSTED."""
    decode_threads: int = 2
    """Threads that decode media (off the event loop)."""
    max_audio_seconds: float = MAX_AUDIO_SECONDS
    """Longest audio clip in seconds, read from its header before decoding."""
    max_video_seconds: float = MAX_VIDEO_SECONDS
    """Longest video in seconds, read from its container header before decoding (frames at most
    --max-image-pixels each)."""
    max_video_fps: float = MAX_VIDEO_FPS
    """Highest video frame rate, read from the container header (a loader reads every frame up to the
    last it samples)."""
    max_video_frames: int = MAX_VIDEO_FRAMES
    """Most frames in one video, read from the container header."""
    decode_timeout_s: float = 30.0
    """Longest decode of one item; past it the decode is stopped and the request refused (as when the
    request is cancelled)."""

    def __post_init__(self) -> None:
        for name in ("max_image_pixels", "max_request_pixels", "decode_budget_mib", "decode_threads",
                     "max_audio_seconds", "max_video_seconds", "max_video_fps", "max_video_frames",
                     "decode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.decode_wait_s < 0:
            raise ValueError(f"decode_wait_s must be >= 0, got {self.decode_wait_s}")

    @property
    def decode_budget_bytes(self) -> int:
        return int(self.decode_budget_mib * (1 << 20))


class MediaDecoder:
    """A service's image decoding under ``MediaConfig``'s limits (see the module
    docstring). Created by the service's wiring, used on its event loop;
    ``close`` stops the decode threads."""

    def __init__(self, cfg: MediaConfig) -> None:
        self.cfg = cfg
        self.budget = ByteBudget(cfg.decode_budget_bytes)
        self.threads = DecodeThreads(cfg.decode_threads)  # each job stopped when its request is

    def check(self, datas: list[bytes], max_images: int) -> int:
        """Header checks of one request's images (nothing decoded); returns its
        decoded bytes. Raises BadInput naming the image and the limit."""
        if len(datas) > max_images:
            raise BadInput(f"{len(datas)} images in one request; this service allows at most {max_images} "
                           "(--max-images-per-prompt)")
        pixels = 0
        for i, data in enumerate(datas):
            try:
                _, w, h = check_image(data, self.cfg.max_image_pixels)
            except MediaError as e:
                raise BadInput(f"image {i}: {e}") from None
            pixels += w * h
        if pixels > self.cfg.max_request_pixels:
            raise BadInput(f"the request's {len(datas)} images have {pixels} pixels together, more than the "
                           f"{self.cfg.max_request_pixels} allowed per request (--max-request-pixels)")
        nbytes = pixels * BYTES_PER_PIXEL
        if nbytes > self.budget.capacity:
            raise BadInput(f"the request's images decode to {nbytes >> 20} MiB, more than this service decodes at "
                           f"once ({self.cfg.decode_budget_mib:g} MiB, --decode-budget-mib)")
        return nbytes

    async def decode(self, datas: list[bytes], max_images: int, rid: str = "") -> tuple[list[Image.Image], DecodeLease]:
        """Checks, waits for budget, decodes off the loop. Returns the RGB images
        and the lease the caller releases once vLLM's processor has them.
        Raises BadInput (over a limit, bad bytes) or NoCapacity (no budget within
        ``decode_wait_s``)."""
        nbytes = self.check(datas, max_images)
        return await self.decode_under_budget(
            nbytes, "image", rid, [functools.partial(_decode_nth, i, data, self.cfg.max_image_pixels)
                                   for i, data in enumerate(datas)])

    async def decode_under_budget(self, nbytes: int, modality: str, rid: str,
                                   jobs: list[Callable[[], Any]]) -> tuple[list[Any], DecodeLease]:
        """Takes ``nbytes`` of the budget (NoCapacity after ``decode_wait_s``), runs ``jobs`` on the
        decode threads, and returns their results with the lease (given back here on failure)."""
        if not await self.budget.acquire(nbytes, self.cfg.decode_wait_s):
            logger.warning("request %s: %d MiB of %s waited %.1fs for the decode budget (%d of %d MiB in use)",
                           rid, nbytes >> 20, modality, self.cfg.decode_wait_s, self.budget.used >> 20,
                           self.budget.capacity >> 20)
            raise NoCapacity(f"this service is decoding {self.budget.used >> 20} MiB of media for other requests "
                             f"(budget {self.cfg.decode_budget_mib:g} MiB); the request's {nbytes >> 20} MiB of "
                             f"{modality} did not fit within {self.cfg.decode_wait_s:g}s; retry later")
        lease = DecodeLease(self.budget, nbytes)
        try:
            out = await self.run_all(jobs, modality)
        except BaseException:
            lease.release()  # the stopped decodes end within a frame; their memory goes with them
            raise
        return out, lease

    async def run_all(self, jobs: list[Callable[[], Any]], what: str) -> list[Any]:
        """Runs ``jobs`` on the decode threads, each under ``decode_timeout_s``; the first failure (or
        the caller's cancellation) stops the others. A timeout is BadInput naming the limit."""
        tasks = [asyncio.ensure_future(self.threads.run(job, self.cfg.decode_timeout_s)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        except asyncio.TimeoutError:
            raise BadInput(f"{what} took longer than {self.cfg.decode_timeout_s:g} s to decode (--decode-timeout-s); "
                           "refused") from None
        finally:
            for t in tasks:
                t.cancel()  # no-op for the finished ones; stops the rest
            await asyncio.gather(*tasks, return_exceptions=True)

    def check_media(self, modality: str, datas: list[bytes], limit: int,
                    sampled_frames: Callable[[VideoHeader], int] | None = None) -> int:
        """Header checks of one request's audio clips or videos (nothing decoded; blocking: run it
        off the event loop); returns their decoded bytes. ``sampled_frames``: how many frames the
        video loader will decode from a clip (default: ``MAX_SAMPLED_FRAMES`` at most). Raises
        BadInput naming the item and the limit."""
        if len(datas) > limit:
            raise BadInput(f"{len(datas)} {modality} items in one request; this service allows at most {limit} "
                           f"(--max-{modality}s-per-prompt)")
        nbytes = 0
        for i, data in enumerate(datas):
            try:
                if modality == "audio":
                    nbytes += check_audio(data, self.cfg.max_audio_seconds)[2]
                else:
                    header = check_video(data, self.cfg.max_video_seconds, self.cfg.max_image_pixels,
                                         max_fps=self.cfg.max_video_fps, max_frames=self.cfg.max_video_frames)
                    sampled = sampled_frames(header) if sampled_frames else min(header.frames, MAX_SAMPLED_FRAMES)
                    nbytes += header.decoded_bytes(max(1, sampled))
            except MediaError as e:
                raise BadInput(f"{modality} {i}: {e}") from None
        if nbytes > self.budget.capacity:
            raise BadInput(f"the request's {modality} decodes to {nbytes >> 20} MiB, more than this service decodes "
                           f"at once ({self.cfg.decode_budget_mib:g} MiB, --decode-budget-mib)")
        return nbytes

    async def decode_media(self, modality: str, datas: list[bytes], limit: int, loader: Callable[[bytes], Any],
                           rid: str = "", sampled_frames: Callable[[VideoHeader], int] | None = None
                           ) -> tuple[list[Any], DecodeLease]:
        """As ``decode`` for audio clips and videos: header checks (off the loop: a container
        parser may take its time), the budget, then ``loader`` (vLLM's ``AudioMediaIO`` /
        ``VideoMediaIO`` ``load_bytes``, as the encoder builds them) off the loop. Returns what the
        loader made, per item, and the lease."""
        (nbytes,) = await self.run_all([functools.partial(self.check_media, modality, datas, limit, sampled_frames)],
                                       f"{modality} header")
        return await self.decode_under_budget(
            nbytes, modality, rid, [functools.partial(_load_nth, modality, i, data, loader)
                                    for i, data in enumerate(datas)])

    def close(self) -> None:
        """Nothing to stop: each decode thread ends with its job (or is stopped with its request)."""


def _decode_nth(i: int, data: bytes, max_pixels: int) -> Image.Image:
    try:
        return decode_image(data, max_pixels=max_pixels)
    except BadInput as e:
        raise BadInput(f"image {i}: {e}") from None


def _load_nth(modality: str, i: int, data: bytes, loader: Callable[[bytes], Any]) -> Any:
    try:
        return loader(data)
    except Exception as e:  # noqa: BLE001 - decoders raise many types for bad data
        raise BadInput(f"{modality} {i} could not be decoded: {e}") from None
