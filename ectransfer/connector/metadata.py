"""Plain picklable metadata between the connector's scheduler and worker halves.

Built fresh every engine step; no sockets, locks or tensors inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata


@dataclass
class LoadSpec:
    """Consumer: copy ``nbytes`` at ``offset`` of shared-memory ``segment`` into
    vLLM's encoder cache. The segment is the encoder's outbound pool when the
    item is read in place (shm transport; the encoder holds it until the
    scheduler half acks after the load), else the scheduler half's inbound
    staging (gRPC chunks). With ``cuda_ref`` (a serialized
    ``epd.common.v1.CudaIpcRef``) the source is the encoder's CUDA pool
    instead: one device-to-device copy."""

    identifier: str
    shape: tuple[int, ...]
    dtype: str
    segment: str
    offset: int
    nbytes: int
    cuda_ref: bytes = b""


@dataclass
class SaveSpec:
    """Producer: copy encoder output ``identifier`` into ``nbytes`` at ``offset``
    of shared-memory ``segment`` (a slot the scheduler half reserved), or of
    the CUDA pool ``cuda_ref`` names (a serialized ``CudaIpcRef``)."""

    identifier: str
    segment: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    cuda_ref: bytes = b""


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    """Consumer: items to inject this step."""
    saves: list[SaveSpec] = field(default_factory=list)
    """Producer: slots reserved this step, one per item to save."""
    notify: str = ""
    """Producer: unix datagram address the worker reports saves to."""
    notify_key: bytes = b""
    """Producer: the key every report starts with (the socket drops datagrams without it)."""
    unmap: list[tuple[str, str]] = field(default_factory=list)
    """Consumer: ("shm", segment) / ("cuda_ipc", pool id) of encoders whose
    stream closed: unmap after this step's loads."""


@dataclass
class EPDWorkerMetadata(ECConnectorWorkerMetadata):
    loaded: list[str] = field(default_factory=list)
    """Consumer: items injected into vLLM's encoder cache this step."""

    def aggregate(self, other: ECConnectorWorkerMetadata) -> EPDWorkerMetadata:
        # Every TP rank injects the same items.
        assert isinstance(other, EPDWorkerMetadata)
        return EPDWorkerMetadata(sorted(set(self.loaded) | set(other.loaded)))
