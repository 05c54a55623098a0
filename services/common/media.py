"""Media decoding and identity. The gateway reads media once; services decode
bytes they were handed and never download anything."""

from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image

from services.common.errors import BadInput, MediaError

MAX_IMAGE_PIXELS = 64_000_000  # decompression-bomb guard (PIL raises beyond 2x)
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP")
"""Formats the gateway accepts (what OpenAI accepts, plus BMP and MPO, the JPEG variant some cameras
write). Only these PIL plugins are tried, so exotic parsers (EPS runs Ghostscript) are never reached."""


def content_id(data: bytes) -> str:
    """The item's identifier: vLLM uses it verbatim as mm_hash on both engines."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decodes an image fully (not lazily) to RGB, or raises BadInput."""
    if not data:
        raise BadInput("image is empty")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > max_pixels:
                raise BadInput(f"image is {img.width}x{img.height}, more than {max_pixels} pixels")
            img.load()
            return img.convert("RGB")
    except BadInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadInput(f"image refused as a decompression bomb: {e}") from None
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
