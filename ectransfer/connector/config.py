"""Connector settings, read from vLLM's ``ec_connector_extra_config``."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ectransfer import factory
from ectransfer.limits import TransferLimits


@dataclass
class ConnectorTuning:
    """The connector's knobs that the services do not set themselves: each is a flag of
    ``epd encoder`` and ``epd lm`` (``--connector-<name>``, e.g. ``--connector-item-wait-s 30``)
    and reaches the engine through ``ec_connector_extra_config``. Producer knobs are ignored by
    a consumer and the other way round."""

    chunk_nbytes: int = 4 << 20
    """GRPC_CHUNKS chunk size."""
    item_wait_s: float = 60.0
    """Producer: how long a Reserve waits for an item that is not encoded yet."""
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
    prefill_in_step: bool = True
    """Consumer: vLLM computes a request's prompt up to its first item that has not landed and goes on as
    items land, in prompt order (needs ``EPDEncoderCacheManager``, which holds vLLM back before an item in
    flight); False holds the whole request until every item has landed."""
    in_place_hold_s: float = 2.0
    """Consumer: an item landed in place that vLLM has not scheduled within this
    time (its request waits for KV space or another item) is copied to staging
    and acked, so it does not keep the encoder's pool pinned."""
    max_sessions: int = 64
    """Producer: concurrent Transfer sessions (gRPC streams, handshake probes included, plus control-lane
    connections); one beyond it is refused (RESOURCE_EXHAUSTED; a lane connection is closed) with a log line."""
    max_reserves_per_session: int = 1024
    """Producer: outstanding Reserves of one session (waiting, being sent, or held for an in-place read);
    one beyond it is answered with ItemError RESOURCE_EXHAUSTED instead of being served."""
    max_stream_queued_bytes: int = 16 << 20
    """Producer: bytes of messages queued for one session that its stream has not taken yet (HTTP/2 flow
    control, or the lane socket's buffer); chunks of further items wait for it to drain."""
    send_stall_s: float = 30.0
    """Producer: an item whose next message cannot be queued for this long (the consumer stopped reading)
    is given up: the producer stops holding its slot for that consumer."""
    max_in_place_hold_s: float = 60.0
    """Producer: an item held for a consumer reading it in place (shm, CUDA IPC) with no Ack or Cancel within
    this time is let go (its lease restarts, then the slot is freed). Consumers ack or demote within
    ``in_place_hold_s``; only a stopped one gets here."""
    max_settled_claims: int = 16384
    """Producer: claims settled (acked, cancelled, aborted) remembered by (claim, identifier), so that an
    encode whose consumer cancelled before the copy existed does not hold it, and a Reserve for a settled
    claim is answered at once; the oldest is forgotten beyond it, with a log line (a copy it would have
    freed then waits out its lease)."""
    keepalive_s: float = 30.0
    """Producer: HTTP/2 ping interval on Transfer connections (consumers ping every 30 s and are allowed to);
    a vanished peer's session ends after ``keepalive_s + keepalive_timeout_s``."""
    keepalive_timeout_s: float = 10.0
    """Producer: an unanswered keepalive ping closes the connection after this long."""

    def __post_init__(self) -> None:
        for name in ("chunk_nbytes", "max_settled_claims", "item_wait_s", "in_place_hold_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.idle_wait_s < 0:
            raise ValueError(f"idle_wait_s must be >= 0, got {self.idle_wait_s}")
        self.transfer_limits()  # ValueError naming a limit that is not > 0

    def transfer_limits(self) -> TransferLimits:
        """The producer's Transfer server bounds (``ectransfer.limits``)."""
        return TransferLimits(**{f.name: getattr(self, f.name) for f in fields(TransferLimits)})

    def extra(self) -> dict[str, Any]:
        """These knobs as ``ec_connector_extra_config`` entries."""
        return {f.name: getattr(self, f.name) for f in fields(ConnectorTuning)}


@dataclass
class ConnectorConfig(ConnectorTuning):
    """Everything the connector halves read (``ConnectorTuning`` plus what the services set)."""

    transfer_host: str = "127.0.0.1"
    """Producer: address the Transfer server binds."""
    advertise_host: str = ""
    """Producer: address LMs dial (default: transfer_host; set the pod IP on Kubernetes)."""
    transfer_port: int = 0
    """Producer: Transfer server port; 0 picks a free one, which only the log names (the
    encoder service passes the port it reserved, so it knows the endpoint up front)."""
    outbound_pool_bytes: int = 256 << 20
    """Producer: bytes of encoder outputs held until acked (backpressure beyond)."""
    host_tier_bytes: int = 0
    """Producer: bytes of the outbound pool that keep encoder outputs after their last consumer is done
    (the host tier, ``ectransfer.outbound``): a repeated item is served from there without a vision
    run; evicted least recently used first, and whenever a reservation needs the room. 0: off."""
    staging_bytes: int = 256 << 20
    """Consumer: bytes of inbound staging (transfers wait when it is full)."""
    transports: list[str] = field(default_factory=lambda: ["auto"])
    """Transports this end may use, best first; ``auto`` expands to what this
    process can use (``factory.resolve``)."""
    lease_s: float = 60.0
    """Producer: an outbound item nobody acked within this time is freed."""
    transfer_timeout_s: float = 30.0
    """Consumer: an item with no data within this time fails its requests."""
    model_name: str = ""
    """Name used in the compatibility hash (default: vLLM's model path)."""
    security: dict[str, Any] = field(default_factory=dict)
    """TLS and auth token for the Transfer link (``peerauth.SecurityConfig.to_dict``): the
    producer's server requires them, the consumer's client presents them."""
    service_pid: int = 0
    """The pid of the service that builds the engine (``ec_transfer_config`` sets it): the EngineCore
    stops itself once that process is gone (``ectransfer.connector.lifeline``); 0: nothing watched."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.transports:
            if name != factory.AUTO:
                factory.transport_enum(name)  # ValueError listing the allowed names
        for name in ("outbound_pool_bytes", "staging_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.host_tier_bytes <= self.outbound_pool_bytes:
            raise ValueError(f"host_tier_bytes must be 0 to outbound_pool_bytes ({self.outbound_pool_bytes}), "
                             f"got {self.host_tier_bytes}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown ec_connector_extra_config keys {unknown}; allowed: {sorted(known)}")
        return cls(**extra)


def ec_transfer_config(role: str, cfg: ConnectorConfig) -> dict[str, Any]:
    """vLLM's ``ec_transfer_config`` for an engine whose EC connector is ours, in ``role``
    (``"ec_producer"``: the encoder; ``"ec_consumer"``: the LM): the one bridge from the services'
    settings to the connector halves, which read ``cfg`` back with ``ConnectorConfig.from_extra``.
    ``cfg`` is built (and so validated) in the service process, before an engine start is spent;
    ``service_pid`` is this process's unless ``cfg`` names one: the engine's lifeline watches it."""
    if role not in ("ec_producer", "ec_consumer"):
        raise ValueError(f"role must be ec_producer or ec_consumer, got {role!r}")
    extra = asdict(replace(cfg, service_pid=cfg.service_pid or os.getpid()))
    return {"ec_connector": "EPDConnector", "ec_connector_module_path": "ectransfer.connector",
            "ec_role": role, "ec_connector_extra_config": extra}
