"""Producer halves (encoder engine, ``ec_role=ec_producer``).

Scheduler half: counts encoder runs per request, tells the worker which
already-cached items to publish, and reports each item's metadata in
``request_finished`` (it lands in the encoder service's RequestOutput).

Worker half: owns the outbound pool and store and the Transfer server thread.
``save_caches`` copies each fresh encoder output into the store; the Transfer
server streams it to the LM and frees it on Ack/Cancel/lease expiry.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any

from ectransfer import factory
from ectransfer.connector.common import compat_for
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.metadata import EPDConnectorMetadata
from ectransfer.outbound import OutboundStore
from ectransfer.pool import Pool
from ectransfer.server import TransferServerThread, TransferServicer

logger = logging.getLogger(__name__)


class ProducerScheduler:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        self._encoder_runs: dict[str, int] = defaultdict(int)

    def build_meta(self, scheduler_output) -> EPDConnectorMetadata:
        meta = EPDConnectorMetadata()
        encoded = scheduler_output.scheduled_encoder_inputs
        for req_id, inputs in encoded.items():
            self._encoder_runs[req_id] += len(inputs)
        for new in scheduler_output.scheduled_new_reqs:
            now = set(encoded.get(new.req_id, ()))
            meta.publish.extend(
                f.identifier for i, f in enumerate(new.mm_features or ()) if i not in now
            )
        return meta

    def request_finished(self, request) -> dict[str, Any]:
        items = {
            f.identifier: {"num_embeds": f.mm_position.get_num_embeds(), "modality": f.modality}
            for f in request.mm_features
        }
        return {"items": items, "encoder_runs": self._encoder_runs.pop(request.request_id, 0)}


class ProducerWorker:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.store: OutboundStore | None = None
        self.server: TransferServerThread | None = None

    def start(self) -> None:
        """Called once the model is resident: allocate the pool, bind Transfer."""
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            if get_tensor_model_parallel_rank() != 0:
                return  # every TP rank computes the same output; rank 0 serves it
        except Exception:  # noqa: BLE001 - not initialised in single-process tests
            pass
        cfg = self.cfg
        self.store = OutboundStore(Pool(cfg.outbound_pool_bytes), ttl_s=cfg.lease_s, put_timeout_s=cfg.put_timeout_s)
        transports = {}
        for name in cfg.transports:
            kwargs = {"chunk_nbytes": cfg.chunk_nbytes} if name == "grpc" else {}
            t = factory.make_producer(name, **kwargs)
            transports[t.kind] = t
        servicer = TransferServicer(
            self.store,
            compat_for(self.vllm_config, cfg.model_name),
            self.vllm_config.ec_transfer_config.engine_id,
            transports,
            item_wait_s=cfg.item_wait_s,
        )
        self.server = TransferServerThread(servicer, cfg.transfer_host, cfg.transfer_port)
        port = self.server.start()
        endpoint = f"{cfg.advertise_host or cfg.transfer_host}:{port}"
        logger.info("EPD transfer server listening on %s (pool %d MiB)", endpoint, cfg.outbound_pool_bytes >> 20)
        if cfg.endpoint_file:
            tmp = cfg.endpoint_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(endpoint)
            os.replace(tmp, cfg.endpoint_file)

    def save(self, encoder_cache, mm_hash: str) -> None:
        if self.store is not None:
            self.store.put(mm_hash, encoder_cache[mm_hash])

    def publish(self, encoder_cache, identifiers: list[str]) -> None:
        if self.store is None:
            return
        for ident in identifiers:
            if ident in encoder_cache and not self.store.contains(ident):
                self.store.put(ident, encoder_cache[ident])

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.store is not None:
            self.store.pool.close()
