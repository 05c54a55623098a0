"""The plain values a request carries through the gateway: its media items (``Media``) and its stage
times (``Timings``). The request model makes them, the orchestration fills them, metrics and the
answers read them; this module imports nothing of the gateway's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Media:
    """One media item of a request, as the gateway read it: its bytes (owned by the request; freed with
    it), its content identifier (``services.common.media.content_id``, in the tenant's namespace) and
    its modality ("image", "audio" or "video")."""

    data: bytes
    identifier: str
    modality: str = "image"
    content_type: str = ""
    """Set for a speech-to-text upload (the whole ``multipart/form-data`` body as the client sent it, this its
    Content-Type): an encoder that cuts speech windows reads its audio and answers one item per window."""


@dataclass
class Timings:
    """Per-request stage times in ms from ``start`` (the request's arrival), and
    what served it. Filled by the orchestration; read by metrics and responses."""

    start: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0
    metadata_ms: float = 0.0
    encode_ms: float = 0.0
    transfer_ms: float = 0.0
    lm_queue_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    total_ms: float = 0.0
    retries: int = 0
    placement: str = ""  # "encoder" or "local" (the LM encoded the images), for image requests
    placement_reason: str = ""
    transports: list[str] = field(default_factory=list)
    encoders: list[str] = field(default_factory=list)
    lm: str = ""
    prefill_ms: float = 0.0
    """E -> P -> D: the PREFILL call, start to the prefill LM's hand-off."""
    prefill_lm: str = ""
    """E -> P -> D: the prefill LM (``lm`` is then the decode LM)."""

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items() if k.endswith("_ms")}

    def since_start_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3
