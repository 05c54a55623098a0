"""Pool and reservation stats through vLLM's own EC-connector stats path.

The scheduler half's ``get_ec_connector_stats`` returns a snapshot each engine
step; vLLM carries it in SchedulerStats to the service process, where
``EPDPromMetrics`` (built by vLLM's Prometheus logger through
``EPDConnector.build_prom_metrics``) sets one gauge per field, labelled by
role. Snapshots are gauges: the latest one wins when vLLM aggregates.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

FIELDS = {
    "pool_capacity_bytes": "Bytes in the outbound pool (producer) or inbound staging (consumer)",
    "pool_used_bytes": "Bytes allocated in that pool",
    "reserved_bytes": "Bytes reserved for items not written yet (producer) or not landed yet (consumer)",
    "pending_reservations": "Items reserved and not yet finalized",
    "items_held": "Producer: encoded items waiting for their consumer's ack",
    "tier_items": "Producer: encoder outputs kept in the host tier after their consumers were done",
    "tier_bytes": "Producer: bytes of the outbound pool the host tier keeps",
    "tier_hits": "Producer: encodes served from the host tier (no new slot, no vision run)",
    "tier_evictions": "Producer: copies the host tier let go (least recently used; or room for a new output)",
    "acks": "Producer: items freed by an ack",
    "cancels": "Items freed because a consumer did not need them (prefix cache, abort, reuse)",
    "expired": "Producer: items freed by lease expiry",
    "failed": "Items that failed (save error, transfer error or timeout)",
    "reuse_hits": "Items served without a new encode (producer) or a new transfer (consumer)",
    "claims": "Producer: unsettled claims on held items (an Encode's or a consumer's, not yet acked or cancelled)",
    "prefill_ahead_tokens": "Consumer: prompt tokens computed while an item of the same request was still in flight",
    "aborted_requests": "Producer: encode requests that ended aborted or failed (their claims dropped)",
}


class EPDConnectorStats(ECConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> EPDConnectorStats:
        return EPDConnectorStats(data={**self.data, **other.data})

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not self.data


class EPDPromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._gauges = {
            name: self._gauge_cls(name=f"epd_ec_{name}", documentation=doc, labelnames=[*labelnames, "role"])
            for name, doc in FIELDS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [*self.per_engine_labelvalues.get(engine_idx, []), transfer_stats_data.get("role", "")]
        for name, gauge in self._gauges.items():
            if name in transfer_stats_data:
                gauge.labels(*labels).set(transfer_stats_data[name])
