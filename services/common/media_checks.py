"""What a media item's bytes say before anything is decoded: its format (sniffed from its first bytes)
and what its header claims (an image's pixels, an audio clip's seconds, a video's seconds, rate and
frame size), checked against the limits, and the one full decode of an image. The gateway checks every
item with these before any service sees it; ``media.MediaDecoder`` checks again before it decodes.
No state, no I/O beyond reading the given bytes."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from services.common.errors import BadInput, MediaError

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


MAX_READS = 65536
"""The most reads PIL's plugin may make of one image's bytes, to open it or to decode it. PIL walks a
header one structure at a time in Python (PNG chunks, JPEG markers and the junk bytes between them, GIF
sub-blocks), each a read or two, so without a bound a 20 MB image of tiny structures costs seconds (a
JPEG of 3.5 million empty markers: 7 s); with it, at most about 0.1 s, whatever the image's size. No
real image comes near: a 20 MB PNG cut in libpng's 8 KiB IDAT chunks takes under 8,000 reads, pixel
data is read in 64 KiB blocks."""


class _TooManyReads(Exception):
    """Raised by ``_Bounded`` (not an OSError, which PIL would read as a truncated image)."""


class _Bounded(io.BytesIO):
    """An image's bytes as PIL reads them: the read after ``MAX_READS`` raises ``_TooManyReads``."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads = 0

    def read(self, size: int | None = -1) -> bytes:
        self.reads += 1
        if self.reads > MAX_READS:
            raise _TooManyReads(f"image needs more than {MAX_READS} reads to parse (a header of that many "
                                "chunks, markers or blocks); refused")
        return super().read(size)


def _check_layout(data: bytes) -> None:
    """Refuses (MediaError) a PNG with more than one iCCP chunk (the format allows one): PIL inflates
    every one, up to 1 MiB each, so 20 MB of 1 KB chunks would inflate 20 GB (a minute of CPU). A walk
    of at most ``MAX_READS`` chunk headers; other formats pass (``_Bounded`` bounds them)."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return
    pos, profiles = 8, 0
    for _ in range(MAX_READS):
        kind = data[pos + 4:pos + 8]
        if len(kind) < 4 or kind == b"IEND":
            return
        profiles += kind == b"iCCP"
        if profiles > 1:
            raise MediaError("image is a PNG with more than one iCCP chunk (the format allows one); refused")
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")


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


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decodes an image fully (not lazily) to RGB, or raises BadInput. Only
    ``IMAGE_FORMATS`` are tried, the header's size is checked against
    ``max_pixels`` before any pixel is decoded, and PIL's work is bounded as in
    ``check_image`` (``MAX_READS``, one iCCP). Blocking and CPU-bound: services
    call it through ``MediaDecoder``, off their event loop."""
    if not data:
        raise BadInput("image is empty")
    try:
        _check_layout(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels decides
            with Image.open(_Bounded(data), formats=IMAGE_FORMATS) as img:
                if img.width * img.height > max_pixels:
                    raise BadInput(f"image is {img.width}x{img.height}, more than {max_pixels} pixels")
                img.load()
                return img.convert("RGB")
    except BadInput:
        raise
    except (MediaError, _TooManyReads) as e:
        raise BadInput(str(e)) from None
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
    decompression-bomb guard: a few KB of PNG can claim gigapixels), and one whose header takes PIL more
    than ``MAX_READS`` reads or inflates more than one ICC profile (``_check_layout``): its work is
    bounded whatever the image's size. The gateway calls this for every image, data: URL or fetched,
    before any service sees it (off its event loop)."""
    if not data:
        raise MediaError("image is empty")
    _check_layout(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            with Image.open(_Bounded(data), formats=IMAGE_FORMATS) as img:
                fmt, (w, h) = img.format, img.size
    except _TooManyReads as e:
        raise MediaError(str(e)) from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"image refused as a decompression bomb ({e}; the limit here is {max_pixels} pixels, "
                         "--max-image-pixels)") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for data it cannot identify
        raise MediaError(f"image is not a recognised image file (accepted: {', '.join(IMAGE_FORMATS)})") from None
    if w * h > max_pixels:
        raise MediaError(f"image is {w}x{h} = {w * h} pixels, more than the {max_pixels} allowed "
                         "(--max-image-pixels; decompression-bomb guard); refused")
    return fmt, w, h
