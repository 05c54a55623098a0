"""LM service configuration. The connector's defaults are ``ConnectorConfig``'s (declared once there)."""

from __future__ import annotations

from dataclasses import dataclass

from ectransfer import factory
from ectransfer.connector.config import ConnectorConfig
from services.common.config import transport_list
from services.common.media import MediaConfig
from services.lm.frontend import FrontendConfig


@dataclass
class LMServiceConfig(FrontendConfig, MediaConfig):
    """The service's own fields; ``FrontendConfig`` adds ``vllm serve``'s front-end flags
    (chat template, tool-call and reasoning parsers, served model name, ...), ``MediaConfig``
    the limits on the media this LM decodes itself (data: URLs the gateway sends when the LM
    encodes a request's items: local placement, fallback, colocated)."""

    host: str = "127.0.0.1"
    """Address of the API port (Generate, GetInfo, health; reflection with --reflection)."""
    port: int = 50061
    """API port (0 picks a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: disabled)."""
    staging_mib: float = ConnectorConfig.staging_bytes / (1 << 20)
    """Inbound staging for encoder outputs (transfers wait when it is full)."""
    transports: str = factory.AUTO
    """Transports this LM may use, best first (comma-separated; allowed: auto, cuda_ipc, shm, grpc).
    ``auto``: cuda_ipc,shm,grpc where the engine has CUDA and cupy, else shm,grpc. The first one
    whose probe succeeds is used; a single name forces it (the handshake fails if it cannot work)."""
    transfer_timeout_s: float = ConnectorConfig.transfer_timeout_s
    """An item with no data from its encoder within this time fails its request."""
    handshake_timeout_s: float = 5.0
    """Compatibility handshake with a new encoder endpoint."""
    allowed_encoders: str = ""
    """Encoder Transfer endpoints this LM may fetch embeddings from, comma-separated: host:port, a host or
    address (any port), a CIDR such as 10.0.0.0/8, or * (any). Empty: any endpoint when callers must
    authenticate (--auth-token-file or mutual TLS: the gateway's word is trusted), else loopback only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.staging_mib <= 0:
            raise ValueError(f"staging_mib must be > 0, got {self.staging_mib}")

    def transport_list(self) -> list[str]:
        return transport_list(self.transports)
