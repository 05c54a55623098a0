"""Connector settings, read from vLLM's ``ec_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ectransfer import factory


@dataclass
class ConnectorConfig:
    transfer_host: str = "127.0.0.1"
    """Producer: address the Transfer server binds."""
    advertise_host: str = ""
    """Producer: address LMs dial (default: transfer_host; set the pod IP on Kubernetes)."""
    transfer_port: int = 0
    """Producer: Transfer server port; 0 picks a free one (reported via endpoint_file)."""
    endpoint_file: str = ""
    """Producer: file the bound ``host:port`` is written to once the server listens."""
    outbound_pool_bytes: int = 256 << 20
    """Producer: bytes of encoder outputs held until acked (backpressure beyond)."""
    staging_bytes: int = 256 << 20
    """Consumer: bytes of inbound staging (transfers wait when it is full)."""
    chunk_nbytes: int = 4 << 20
    """GRPC_CHUNKS chunk size."""
    transports: list[str] = field(default_factory=lambda: ["auto"])
    """Transports this end may use, best first; ``auto`` expands to what this
    process can use (``factory.resolve``)."""
    lease_s: float = 60.0
    """Producer: an outbound item nobody acked within this time is freed."""
    item_wait_s: float = 60.0
    """Producer: how long a Reserve waits for an item that is not encoded yet."""
    transfer_timeout_s: float = 30.0
    """Consumer: an item with no data within this time fails its requests."""
    read_in_place: bool = True
    """Consumer: with shm or CUDA IPC, vLLM's worker copies each item straight
    from the encoder's memory into its encoder cache (one copy; staging is reserved, not written) and
    the ack follows the load; False lands it in staging first (two copies)."""
    idle_wait_s: float = 0.01
    """Consumer: when an engine step has nothing to compute and requests only wait for
    embeddings, the scheduler waits for the next transfer event up to this long
    instead of stepping again in 1 ms (each step also calls the worker: a waiting
    request would otherwise keep about 1.4 cores busy on a CPU host). A request that
    arrives meanwhile starts at most this much later."""
    in_place_hold_s: float = 2.0
    """Consumer: an item landed in place that vLLM has not scheduled within this
    time (its request waits for KV space or another item) is copied to staging
    and acked, so it does not keep the encoder's pool pinned."""
    model_name: str = ""
    """Name used in the compatibility hash (default: vLLM's model path)."""

    def __post_init__(self) -> None:
        for name in self.transports:
            if name != factory.AUTO:
                factory.transport_enum(name)  # ValueError listing the allowed names
        for name in ("outbound_pool_bytes", "staging_bytes", "chunk_nbytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown ec_connector_extra_config keys {unknown}; allowed: {sorted(known)}")
        return cls(**extra)
