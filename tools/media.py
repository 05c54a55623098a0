"""Deterministic test and demo media: images and audio clips (no downloads)."""

from __future__ import annotations

import base64
import functools
import io
import struct
import tempfile
import zlib

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


@functools.lru_cache(maxsize=4)
def bomb_png(side: int = 20000) -> bytes:
    """A valid 1-bit greyscale PNG of side x side black pixels: a few tens of KB that decode to side²
    pixels (400 M for the default). For tests of the gateway's decompression-bomb guard."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    z = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the packed bits
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def make_audio(seed: int = 0, seconds: float = 1.0, rate: int = 16000, fmt: str = "WAV", channels: int = 1) -> bytes:
    """A clip of ``seconds`` at ``rate`` Hz: a seeded chord of tones with a little noise (each further
    channel the first one delayed), in ``fmt`` (a soundfile format: WAV, FLAC, OGG, MP3)."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    wave = sum(0.2 * np.sin(2 * np.pi * f * t) for f in rng.uniform(110, 2000, size=3))
    wave = (wave + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)
    if channels > 1:
        wave = np.stack([np.roll(wave, 37 * c) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt)
    return buf.getvalue()


def make_video(seed: int = 0, frames: int = 8, size: tuple[int, int] = (64, 48), fps: float = 4.0) -> bytes:
    """An MP4 (MPEG-4 part 2, OpenCV's writer) of ``frames`` seeded noise frames of ``size`` (w, h)."""
    import cv2

    rng = np.random.default_rng(seed)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        writer = cv2.VideoWriter(f.name, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
        try:
            for _ in range(frames):
                writer.write(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        finally:
            writer.release()
        return f.read()
