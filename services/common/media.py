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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from services.common.budget import ByteBudget, DecodeLease
from services.common.errors import BadInput, MediaError, NoCapacity
from services.common.interruptible import DecodeThreads
from services.common.media_checks import (
    BYTES_PER_PIXEL,
    MAX_AUDIO_SECONDS,
    MAX_IMAGE_PIXELS,
    MAX_SAMPLED_FRAMES,
    MAX_VIDEO_FPS,
    MAX_VIDEO_FRAMES,
    MAX_VIDEO_SECONDS,
    VideoHeader,
    check_audio,
    check_image,
    check_video,
    decode_image,
)

logger = logging.getLogger(__name__)

OFF_LOOP_BYTES = 1 << 20
"""An item this large is hashed (``content_id``), or its data: URL decoded (the gateway's pybase64), or a
body this large has its prefix keys derived, on a thread rather than on an event loop: hashlib and
pybase64 release the GIL while they work, so the loop answers others meanwhile. A smaller one costs less
than the thread hop."""


async def off_loop(nbytes: int, fn, *args):
    """``fn(*args)`` for an item of ``nbytes``: on a thread from ``OFF_LOOP_BYTES`` (``fn`` must spend its
    time with the GIL released: hashlib, pybase64), else here, where the thread hop would cost more than
    the work."""
    return await asyncio.to_thread(fn, *args) if nbytes >= OFF_LOOP_BYTES else fn(*args)


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


def window_wav(samples, rate: int) -> bytes:
    """One window of a speech upload (vLLM's speech-to-text serving cuts an upload's audio into windows of at
    most the model's clip length, each a float32 mono array at the model's rate) as a 32-bit float WAV file:
    the bytes a window's identifier is the ``content_id`` of. The encoder (which cuts and encodes the
    windows) and the LM (whose vLLM cuts the same upload again, and names each window it is about to
    encode by this rule) compute it from the same samples; a window the two cut differently gets two
    identifiers, so the LM finds no source for it and encodes it itself: slower, never wrong."""
    import numpy as np

    pcm = np.ascontiguousarray(samples, dtype="<f4").reshape(-1).tobytes()
    fmt = b"fmt " + (16).to_bytes(4, "little") + (3).to_bytes(2, "little") + (1).to_bytes(2, "little") \
        + int(rate).to_bytes(4, "little") + (int(rate) * 4).to_bytes(4, "little") + (4).to_bytes(2, "little") \
        + (32).to_bytes(2, "little")
    data = b"data" + len(pcm).to_bytes(4, "little") + pcm
    return b"RIFF" + (4 + len(fmt) + len(data)).to_bytes(4, "little") + b"WAVE" + fmt + data


def window_id(samples, rate: int, namespace: str = "") -> str:
    """The identifier of one window of a speech upload: ``content_id`` of ``window_wav``."""
    return content_id(window_wav(samples, rate), namespace)


def check_namespace(namespace: str) -> str:
    """``namespace`` as a request carried it, or BadInput when it is too long to be a tenant's."""
    if len(namespace.encode()) > MAX_NAMESPACE_LEN:
        raise BadInput(f"an embedding namespace is at most {MAX_NAMESPACE_LEN} bytes, got {len(namespace.encode())}")
    return namespace


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
