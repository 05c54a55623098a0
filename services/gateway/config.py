"""Gateway configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    """Address of the HTTP (OpenAI) and gRPC listeners."""
    port: int = 8000
    """OpenAI-compatible HTTP port."""
    grpc_port: int = 0
    """Native gRPC API port (0: disabled)."""
    encoders: str = ""
    """Encoder API addresses, comma-separated host:port (none: colocated, the LMs encode media themselves)."""
    lms: str = ""
    """LM API addresses, comma-separated host:port."""
    model_name: str = ""
    """Name served on /v1/models (default: the LM's model)."""
    request_timeout_s: float = 120.0
    """End-to-end limit for one request."""
    max_image_bytes: int = 20 << 20
    """Largest accepted encoded image."""
    max_images: int = 8
    """Most images in one request."""

    def __post_init__(self) -> None:
        if not [a for a in self.lms.split(",") if a]:
            raise ValueError("at least one LM address is needed (--lms host:port[,host:port])")

    @property
    def encoder_list(self) -> list[str]:
        return [a for a in self.encoders.split(",") if a]

    @property
    def lm_list(self) -> list[str]:
        return [a for a in self.lms.split(",") if a]
