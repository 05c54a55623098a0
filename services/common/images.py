"""Deterministic test and demo images (no downloads)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def make_image(seed: int = 0, size: tuple[int, int] = (112, 112)) -> bytes:
    """A PNG of seeded noise over a colour gradient."""
    w, h = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) * 255 // max(w + h - 2, 1)], -1)
    noise = rng.integers(0, 96, size=(h, w, 3))
    img = Image.fromarray(((base + noise) % 256).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
