"""``EPDConnector``, the facade vLLM builds (see the package docstring)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from ectransfer.connector import lifeline
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
from ectransfer.connector.halves import (
    ConsumerWorkerHalf,
    ProducerWorkerHalf,
    SchedulerHalf,
    WorkerHalf,
)
from ectransfer.connector.metadata import EPDConnectorMetadata
from ectransfer.connector.producer import ProducerScheduler, ProducerWorker
from ectransfer.connector.stats import EPDConnectorStats, EPDPromMetrics


class EPDConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        if ec.ec_role == "ec_both":
            raise ValueError("EPDConnector supports ec_role ec_producer or ec_consumer, not ec_both")
        cfg = ConnectorConfig.from_extra(dict(ec.ec_connector_extra_config))
        lifeline.hold(cfg.service_pid)  # this engine process stops once its service is gone
        Sched, Worker = ((ProducerScheduler, ProducerWorker) if self.is_producer
                         else (ConsumerScheduler, ConsumerWorker))
        # Exactly one half per role (``ectransfer.connector.halves`` names what each offers).
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = Sched(vllm_config, cfg).start()
        else:
            self._worker = Worker(vllm_config, cfg).start()

    # -- worker side ----------------------------------------------------------

    def start_save_caches(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(self._worker, ProducerWorkerHalf) and isinstance(meta, EPDConnectorMetadata) and (
                meta.saves or meta.drops):
            self._worker.begin_step(kwargs["encoder_cache"], meta)

    def save_caches(self, encoder_cache, mm_hash: str, **kwargs: Any) -> None:
        if isinstance(self._worker, ProducerWorkerHalf):
            self._worker.save(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(self._worker, ConsumerWorkerHalf) and isinstance(meta, EPDConnectorMetadata) and (
                meta.loads or meta.unmap):
            self._worker.load(encoder_cache, meta)

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta() if self._worker is not None else None

    # -- scheduler side -------------------------------------------------------

    @property
    def _sched(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side EC connector hook was called on the worker's connector")
        return self._scheduler

    def has_cache_item(self, identifier: str) -> bool:
        return self._sched.has_cache_item(identifier)

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        return self._sched.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request, index: int) -> None:
        self._sched.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output) -> EPDConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        return self._sched.take_unavailable()

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        # Never delay_free: in vLLM 0.32 that leaks the request. The half's typed
        # result (metadata.ConsumerFinished / ProducerFinished) travels as its dict.
        return False, self._sched.request_finished(request).to_dict() or None

    # -- stats (vLLM carries these to the service's Prometheus registry) ----

    def get_ec_connector_stats(self):
        if self._scheduler is None:  # the workers keep no stats
            return None

        return EPDConnectorStats(data=self._scheduler.stats_snapshot())

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        return EPDConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._scheduler, self._worker):
            if half is not None:
                half.shutdown()
