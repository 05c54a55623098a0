"""Media decoding and identity. The gateway reads media once; services decode
bytes they were handed and never download anything."""

from __future__ import annotations

import hashlib
import io

from PIL import Image

from services.common.errors import BadInput

MAX_IMAGE_PIXELS = 64_000_000  # decompression-bomb guard (PIL raises beyond 2x)


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
