"""Plain picklable metadata between the connector's scheduler and worker halves.

Built fresh every engine step; no sockets, locks or tensors inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata


@dataclass
class LoadSpec:
    """Consumer: copy ``nbytes`` at ``offset`` of shared-memory ``segment`` (the
    scheduler half's inbound staging) into vLLM's encoder cache."""

    identifier: str
    shape: tuple[int, ...]
    dtype: str
    segment: str
    offset: int
    nbytes: int


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    """Consumer: items to inject this step."""
    publish: list[str] = field(default_factory=list)
    """Producer: items already in vLLM's encoder cache (not re-encoded this
    step) to put in the outbound store if it no longer holds them."""


@dataclass
class EPDWorkerMetadata(ECConnectorWorkerMetadata):
    loaded: list[str] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> "EPDWorkerMetadata":
        assert isinstance(other, EPDWorkerMetadata)
        return EPDWorkerMetadata(sorted(set(self.loaded) | set(other.loaded)))
