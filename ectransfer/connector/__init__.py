"""``EPDConnector``: epd-serve's vLLM EC connector, one class for both roles.

Load it with::

    --ec-transfer-config '{"ec_connector": "EPDConnector",
                           "ec_connector_module_path": "ectransfer.connector",
                           "ec_role": "ec_producer" | "ec_consumer",
                           "ec_connector_extra_config": {...ConnectorConfig...}}'

vLLM builds it twice per engine: role SCHEDULER in the EngineCore's scheduler
and role WORKER in each worker. This facade picks the matching half:

    producer, scheduler: ProducerScheduler  outbound pool + reservations + Transfer server
    producer, worker:    ProducerWorker     copies encoder outputs into reserved slots
    consumer, scheduler: ConsumerScheduler  reserves staging, pulls items, defers requests
    consumer, worker:    ConsumerWorker     injects staged bytes into vLLM's encoder cache

Every hook returns fast; network I/O runs on the halves' own threads.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.metadata import EPDConnectorMetadata

__all__ = ["EPDConnector", "ConnectorConfig"]


class EPDConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        if ec.ec_role == "ec_both":
            raise ValueError("EPDConnector supports ec_role ec_producer or ec_consumer, not ec_both")
        cfg = ConnectorConfig.from_extra(dict(ec.ec_connector_extra_config))
        if self.is_producer:
            from ectransfer.connector.producer import ProducerScheduler, ProducerWorker

            half = ProducerScheduler if role == ECConnectorRole.SCHEDULER else ProducerWorker
        else:
            from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker

            half = ConsumerScheduler if role == ECConnectorRole.SCHEDULER else ConsumerWorker
        self._half: Any = half(vllm_config, cfg)

    # -- worker side ----------------------------------------------------------

    def start_save_caches(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.is_producer and isinstance(meta, EPDConnectorMetadata) and meta.saves:
            self._half.begin_step(kwargs["encoder_cache"], meta)

    def save_caches(self, encoder_cache, mm_hash: str, **kwargs: Any) -> None:
        if self.is_producer:
            self._half.save(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.is_consumer and isinstance(meta, EPDConnectorMetadata) and (meta.loads or meta.unmap):
            self._half.load(encoder_cache, meta)

    def build_connector_worker_meta(self):
        return self._half.build_worker_meta()

    # -- scheduler side -------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self.is_consumer and self._half.has_cache_item(identifier)

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        return self._half.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request, index: int) -> None:
        if self.is_consumer:
            self._half.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output) -> EPDConnectorMetadata:
        return self._half.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._half.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        return self._half.take_unavailable()

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        # Never delay_free: in vLLM 0.32 that leaks the request. The half's typed
        # result (metadata.ConsumerFinished / ProducerFinished) travels as its dict.
        return False, self._half.request_finished(request).to_dict() or None

    # -- stats (vLLM carries these to the service's Prometheus registry) ----

    def get_ec_connector_stats(self):
        snapshot = getattr(self._half, "stats_snapshot", None)  # scheduler halves only
        if snapshot is None:
            return None
        from ectransfer.connector.stats import EPDConnectorStats

        return EPDConnectorStats(data=snapshot())

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        from ectransfer.connector.stats import EPDConnectorStats

        return EPDConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from ectransfer.connector.stats import EPDPromMetrics

        return EPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        shutdown = getattr(self._half, "shutdown", None)
        if shutdown is not None:
            shutdown()
