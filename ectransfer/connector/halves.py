"""The contracts between ``EPDConnector`` (vLLM's facade) and its four halves.

vLLM builds the connector once per role; the facade holds exactly one half
(``ectransfer.connector.EPDConnector``) and calls only what these Protocols
name. Each half owns what it allocates: the producer scheduler its outbound
pool, store and Transfer server; the consumer scheduler its staging and
transfer client; the workers their mappings of other processes' memory. Each
frees it in ``shutdown``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ectransfer.connector.metadata import (
    ConsumerFinished,
    EPDConnectorMetadata,
    EPDWorkerMetadata,
    ProducerFinished,
)


@runtime_checkable
class SchedulerHalf(Protocol):
    """Runs in the EngineCore process, on vLLM's scheduler thread. Its constructor only
    allocates; ``start`` binds sockets and starts threads, ``shutdown`` stops and frees."""

    def start(self) -> SchedulerHalf: ...

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        """Stage 1 of the two-stage allocation: True once ``request`` may be scheduled."""

    def has_cache_item(self, identifier: str) -> bool:
        """Consumer: the item landed and vLLM may load it instead of encoding. Producer: the outbound
        store holds it (the host tier), so vLLM may skip the vision run."""

    def update_state_after_alloc(self, request, index: int) -> None:
        """vLLM allocated the item's encoder-cache room. Consumer: queue its load; producer: note room
        that is never written (an item the store holds)."""

    def build_meta(self, scheduler_output) -> EPDConnectorMetadata:
        """This step's instructions for the worker half."""

    def update_connector_output(self, output) -> None:
        """The worker half's report for the last step."""

    def take_unavailable(self) -> set[str]:
        """Requests whose encoder outputs cannot be had (vLLM fails them)."""

    def request_finished(self, request) -> ConsumerFinished | ProducerFinished:
        """``request`` ended: release what it held; its typed result."""

    def stats_snapshot(self) -> dict[str, Any]:
        """Pool and reservation numbers (``ectransfer.connector.stats.FIELDS``)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class WorkerHalf(Protocol):
    """Runs in vLLM's worker process (the model runner's thread); ``start`` as above."""

    def start(self) -> WorkerHalf: ...

    def build_worker_meta(self) -> EPDWorkerMetadata | None:
        """This step's report for the scheduler half (None: nothing to say)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class ProducerWorkerHalf(WorkerHalf, Protocol):
    def begin_step(self, encoder_cache, meta: EPDConnectorMetadata) -> None:
        """Takes this step's reserved slots; writes items vLLM already holds."""

    def save(self, encoder_cache, mm_hash: str) -> None:
        """Copies one fresh encoder output into its reserved slot and reports it."""


@runtime_checkable
class ConsumerWorkerHalf(WorkerHalf, Protocol):
    def load(self, encoder_cache, meta: EPDConnectorMetadata) -> None:
        """Copies this step's landed items into vLLM's encoder cache."""
