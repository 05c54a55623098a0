"""Encoder service configuration. The connector's defaults are ``ConnectorConfig``'s (declared once there)."""

from __future__ import annotations

from dataclasses import dataclass

from ectransfer import factory
from ectransfer.connector.config import ConnectorConfig
from services.common.config import transport_list
from services.common.media import MediaConfig


@dataclass
class EncoderServiceConfig(MediaConfig):
    """The service's own fields; the image decoding limits come from ``MediaConfig``."""

    host: str = "127.0.0.1"
    """Address of the API port (Encode, GetInfo, health; reflection with --reflection)."""
    port: int = 50051
    """API port (0 picks a free one)."""
    transfer_host: str = ConnectorConfig.transfer_host
    """Address the Transfer server (inside the engine process) binds."""
    advertise_host: str = ""
    """Address LMs dial for Transfer (default: transfer_host; the pod IP on Kubernetes)."""
    transfer_port: int = 0
    """Transfer port (0 picks a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0: disabled)."""
    metrics_host: str = "127.0.0.1"
    """Address of --metrics-port, loopback whatever --host is: plain HTTP, open to this host. Any other address
    needs what --host needs there (TLS and authenticated scrapers, or --insecure) and serves HTTPS with
    --tls-cert, asking a client certificate (--tls-ca) and the token (--auth-token-file) where set."""
    outbound_pool_mib: float = ConnectorConfig.outbound_pool_bytes / (1 << 20)
    """Outbound pool size: encoder outputs held until an LM acks them."""
    host_tier_mib: float = -1.0
    """Of the outbound pool, how much keeps encoder outputs after their LMs have them (the host tier): a
    repeated image is then served without a vision run. Least recently used first out, and whenever a
    new output needs the room (never backpressure). 0: off; -1: a quarter of the pool (64 of 256 MiB)."""
    transports: str = factory.AUTO
    """Transports offered to LMs (comma-separated; allowed: auto, cuda_ipc, shm, grpc). ``auto``:
    cuda_ipc,grpc where the engine has CUDA and cupy (the outbound pool is then on the GPU), else shm,grpc."""
    lease_s: float = ConnectorConfig.lease_s
    """An outbound item nobody acked within this time is freed."""
    encode_timeout_s: float = 60.0
    """An Encode that takes longer fails with DEADLINE_EXCEEDED."""
    drain_grace_s: float = 30.0
    """On SIGTERM: how long this instance may take to finish the work it holds before it stops (it turns
    NOT_SERVING at once, so gateways route it nothing new; services/common/drain.py). What is still in flight
    then is cut (the gateway retries it elsewhere before its first token). 0: stop at once. A supervisor's
    kill timeout (Kubernetes' terminationGracePeriodSeconds) must be longer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outbound_pool_mib <= 0:
            raise ValueError(f"outbound_pool_mib must be > 0, got {self.outbound_pool_mib}")
        if not (self.host_tier_mib == -1 or 0 <= self.host_tier_mib <= self.outbound_pool_mib):
            raise ValueError(f"host_tier_mib must be -1 (a quarter of the pool) or 0 to outbound_pool_mib "
                             f"({self.outbound_pool_mib}), got {self.host_tier_mib}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")

    def host_tier_bytes(self) -> int:
        mib = self.outbound_pool_mib / 4 if self.host_tier_mib == -1 else self.host_tier_mib
        return int(mib * (1 << 20))

    def transport_list(self) -> list[str]:
        return transport_list(self.transports)
