"""Producer halves (encoder engine, ``ec_role=ec_producer``).

Scheduler half (EngineCore process, not pinned to the worker's cores): owns the
outbound pool (a shared-memory segment; with the ``cuda_ipc`` transport one
exported device allocation on the engine's GPU instead), the outbound store
and the Transfer server thread. Two-stage allocation on this side too:

1. ``ensure_cache_available`` reserves a slot for every item of a request that
   the store does not hold yet, all or nothing; when the pool is full the
   request is deferred (backpressure: it waits, nothing is dropped, memory is
   bounded).
2. ``build_meta`` hands the worker a ``SaveSpec`` (segment, offset) per
   reserved item; the worker copies the encoder output into it and reports
   back over a unix datagram socket; the report finalizes the slot into the
   store, where the Transfer server can send it. (vLLM 0.32's encoder-only
   runner drops the worker's EC connector output -- it returns
   ``make_empty_encoder_model_runner_output`` -- so ``update_connector_output``
   never sees producer reports; the socket is our own channel instead.)

Claims (``ectransfer.outbound``): each encode request carries its Encode call's
claim (``ProducerParams`` in its ``ec_transfer_params``; the request id when
absent). ``ensure_cache_available`` claims the copy the store holds, or the
reservation in flight, or makes a reservation for the claim; the worker's
report hands the reservation's claims to ``OutboundStore.adopt``. A request
that ends aborted (the encoder service aborts it when its Encode call is
cancelled or times out) or failed drops its claims: a copy nobody else claims
is freed at once (on arrival if it is still being written), not a lease later.
vLLM's own abort is the channel from the service.

A reservation (state RESERVED) is freed by the store once adopted (acks,
cancels, lease), by the worker's failure report, here when every request it
was made for ends before dispatch, or, when they were aborted after it was
handed to the worker but before it was written (vLLM hands every new slot over
at the next step, the item may be encoded steps later), on the worker's drop
report: the next step's metadata lists it in ``drops``, the worker forgets the
slot and reports (a save that won the race reports first and is adopted).

Worker reports travel over an abstract-namespace unix datagram socket, which
any process on the host can send to (abstract sockets have no file
permissions, and SO_PEERCRED does not exist for datagrams). Each report
therefore starts with a random per-engine key (``REPORT_KEY_NBYTES``) that
reaches the worker only inside vLLM's own scheduler-to-worker metadata;
datagrams without it are dropped unread. (A filesystem socket in a 0700
directory would work too, but needs a path to create and remove on every exit.)

Worker half (vLLM's worker process): maps the segment (or opens the CUDA
pool's handle; in the scheduler's own process it uses the pool directly) once
and copies each fresh (``save_caches``) or already-cached
(``start_save_caches``) encoder output into its slot. It never allocates.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.v1.request import RequestStatus

from ectransfer import cuda_ipc, factory, tensors
from ectransfer.connector.cache_manager import manager_for
from ectransfer.connector.common import compat_for
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.metadata import (
    EPDConnectorMetadata,
    FinishedItem,
    ProducerFinished,
    ProducerParams,
    SaveSpec,
)
from ectransfer.cuda_ipc import CudaPool
from ectransfer.outbound import CopyState, OutboundStore, move
from ectransfer.pool import PoolFullError, Slot
from ectransfer.server import TransferServerThread, TransferServicer
from ectransfer.shm import Mappings, new_name
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Reserved:
    """A copy in state RESERVED: its slot is this half's until adopted or freed."""

    identifier: str
    slot: Slot
    shape: tuple[int, int]
    requests: set[str] = field(default_factory=set)
    claims: set[str] = field(default_factory=set)
    dispatched: bool = False
    state: CopyState = CopyState.RESERVED


REPORT_KEY_NBYTES = 16


class ProducerScheduler:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        mc = vllm_config.model_config
        self.dtype = mc.dtype
        self.widths = dict(vllm_config.ec_transfer_config.mm_encoder_output_widths)
        self.default_width = mc.get_hidden_size()
        # The transport with the highest pool priority makes the outbound pool
        # (CUDA IPC: one device allocation on this engine's GPU, exported once,
        # which the worker writes into in this process or through the handle;
        # else shared memory); those that cannot describe it are not offered.
        self.pool, transports, names = factory.make_producers(
            factory.resolve(cfg.transports, "producer"), cfg.outbound_pool_bytes, cfg.chunk_nbytes)
        self._transports = transports  # closed with the pool in shutdown
        self.cuda_pool = self.pool if isinstance(self.pool, CudaPool) else None
        self.store = OutboundStore(self.pool, ttl_s=cfg.lease_s, max_settled_claims=cfg.max_settled_claims,
                                   keep_bytes=cfg.host_tier_bytes)
        self.engine_id = vllm_config.ec_transfer_config.engine_id
        self._external: set[str] = set()  # items has_cache_item said yes to, this step
        servicer = TransferServicer(self.store, compat_for(vllm_config, cfg.model_name),
                                    vllm_config.ec_transfer_config.engine_id, transports,
                                    item_wait_s=cfg.item_wait_s, stats_fn=lambda: self.stats_snapshot(),
                                    limits=cfg.transfer_limits(), widths=self.widths)
        self.server = TransferServerThread(servicer, cfg.transfer_host, cfg.transfer_port,
                                           security=SecurityConfig.from_dict(cfg.security))
        self._cfg, self._names, self._started = cfg, names, False
        self._reserved: dict[str, _Reserved] = {}
        self._failed = 0
        self._seen: set[str] = set()  # requests whose reservation succeeded (reuse counted once)
        self._reuse_hits = 0  # items a request needed that the store already held
        self._unavailable: set[str] = set()
        self._encoder_runs: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # _reserved/_unavailable: scheduler thread + report thread
        self._aborted = 0  # encode requests that ended aborted or failed (their claims dropped)
        self._drops: list[str] = []  # dispatched reservations of aborted requests, for the next step
        self._refused_reports = 0
        # Abstract-namespace socket: no file to clean up, gone with the process;
        # a report must carry this key (see the module docstring).
        self.notify_addr = "\0" + new_name("notify")
        self.report_key = secrets.token_bytes(REPORT_KEY_NBYTES)

    def start(self) -> ProducerScheduler:
        """Binds the Transfer server and the worker-report socket and starts their
        thread (once; the facade calls this when vLLM has built the half)."""
        if self._started:
            return self
        port = self.server.start()
        self._started = True
        cfg = self._cfg
        logger.info("EPD transfer server on %s:%d, outbound pool %s (%d MiB, transports %s)",
                    cfg.advertise_host or cfg.transfer_host, port,
                    self.pool.pool_id if self.cuda_pool is not None else self.pool.name,
                    cfg.outbound_pool_bytes >> 20, ",".join(self._names))
        self.server.add_datagram_endpoint(self.notify_addr, self._on_report)
        return self

    def _shape(self, feat) -> tuple[int, int]:
        return feat.mm_position.get_num_embeds(), self.widths.get(feat.modality, self.default_width)

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        with self._lock:
            return self._reserve(request)

    def has_cache_item(self, identifier: str) -> bool:
        """vLLM asks (after ``ensure_cache_available`` claimed the request's copies) whether it may skip the
        vision run: yes when the store holds a copy (the host tier, or another request's) and none is being
        written for it. Only with our encoder cache manager, which drops the room vLLM allocates for it
        (``cache_manager``); without it, always no (the vision runs, as before)."""
        if manager_for(self.engine_id) is None:
            return False
        with self._lock:
            held = identifier not in self._reserved and self.store.contains(identifier)
            if held:
                self._external.add(identifier)
        return held

    def update_state_after_alloc(self, request, index: int) -> None:
        ident = request.mm_features[index].identifier
        with self._lock:
            external = ident in self._external
            self._external.discard(ident)
        manager = manager_for(self.engine_id)
        if external and manager is not None:
            manager.mark_external(ident)

    def _reserve(self, request) -> bool:
        manager = manager_for(self.engine_id)
        missing = {}
        claims = _claims_of(request)
        for feat in request.mm_features:
            ident = feat.identifier
            res = self._reserved.get(ident)
            if res is not None:
                res.requests.add(request.request_id)
                res.claims.update(c for c in claims if not self.store.settled(ident, c))
            elif not self.store.claim(ident, claims[0]):
                missing[ident] = self._shape(feat)
            elif any(not self.store.claim(ident, c) for c in claims[1:]):  # freed in between: encode it again
                missing[ident] = self._shape(feat)
            elif request.request_id not in self._seen:
                self._reuse_hits += 1
        if manager is not None and any(manager.is_external(i) for i in missing):
            # vLLM holds room for an output it never had (served from the store, which has since let it
            # go): it would skip the vision run for this request too. Wait the step or two until that
            # request lets go of it.
            return False
        slots: dict[str, Slot] = {}
        for ident, shape in missing.items():
            try:
                slot = self.store.try_alloc(tensors.nbytes_of(shape, self.dtype))
            except PoolFullError as e:
                logger.error("request %s: %s", request.request_id, e)
                self._unavailable.add(request.request_id)
                slot = None
            if slot is None:  # all or nothing, so two requests never hold half each
                for s in slots.values():
                    self.pool.free(s)
                return False
            slots[ident] = slot
        for ident, slot in slots.items():
            self._reserved[ident] = _Reserved(ident, slot, missing[ident], {request.request_id}, set(claims))
        self._seen.add(request.request_id)
        return True

    def build_meta(self, scheduler_output) -> EPDConnectorMetadata:
        for req_id, inputs in scheduler_output.scheduled_encoder_inputs.items():
            self._encoder_runs[req_id] += len(inputs)
        meta = EPDConnectorMetadata(notify=self.notify_addr, notify_key=self.report_key)
        with self._lock:
            meta.drops, self._drops = self._drops, []
            for ident, res in self._reserved.items():
                if not res.dispatched:
                    res.dispatched = True
                    cuda = self.cuda_pool is not None
                    meta.saves.append(SaveSpec(
                        ident, "" if cuda else self.pool.name, res.slot.offset, res.slot.nbytes, res.shape,
                        tensors.dtype_name(self.dtype),
                        cuda_ref=self.cuda_pool.ref(res.slot.offset).SerializeToString() if cuda else b""))
        return meta

    def _on_report(self, data: bytes) -> None:
        """A worker's report (Transfer server thread): finalize or fail a slot.
        Datagrams without this engine's key are dropped unread."""
        if not hmac.compare_digest(data[:REPORT_KEY_NBYTES], self.report_key):
            self._refused_reports += 1
            if self._refused_reports == 1 or self._refused_reports % 1000 == 0:
                logger.warning("dropped %d datagram(s) on the worker-report socket without this engine's key "
                               "(another process on this host is sending to it)", self._refused_reports)
            return
        report = json.loads(data[REPORT_KEY_NBYTES:])
        ident = report["id"]
        with self._lock:
            res = self._reserved.get(ident)
            if res is not None and report.get("dropped") and res.requests:
                # A request for the item came after the drop was sent: hand the slot over again.
                res.dispatched = False
                return
            self._reserved.pop(ident, None)
            if res is not None and report.get("error"):
                self._unavailable |= res.requests
            claims = set(res.claims) if res is not None else set()
        if res is None:
            return
        if report.get("dropped"):  # handed to the worker, never encoded: every request for it was aborted
            move(res, CopyState.FREED)
            self.pool.free(res.slot)
            return
        if report.get("error"):
            self._failed += 1
            logger.error("encoder output %s could not be saved: %s", ident, report["error"])
            move(res, CopyState.FREED)
            self.pool.free(res.slot)
            self.store.mark_failed(ident, report["error"])
        else:
            move(res, CopyState.HELD)
            if self.store.adopt(ident, res.slot, res.shape, self.dtype, claims) is None:
                logger.info("encoder output %s freed on arrival: every claim on it was settled (its encode "
                            "aborted, or its consumer cancelled) and nobody asked for it", ident)

    def update_connector_output(self, output) -> None:
        return None  # see the module docstring: reports arrive on the socket

    def stats_snapshot(self) -> dict[str, Any]:
        with self._lock:
            reserved = list(self._reserved.values())
        store = self.store.snapshot()
        return {
            "role": "producer",
            "pool_capacity_bytes": store["capacity_bytes"],
            "pool_used_bytes": store["used_bytes"],
            "reserved_bytes": sum(r.slot.nbytes for r in reserved),
            "pending_reservations": len(reserved),
            "items_held": store["items"],
            "tier_items": store["tier_items"],
            "tier_bytes": store["tier_bytes"],
            "tier_hits": store["tier_hits"],
            "tier_evictions": store["tier_evictions"],
            "acks": store["acks"],
            "cancels": store["cancels"],
            "expired": store["expired"],
            "failed": store["items_dropped"] + self._failed,
            "reuse_hits": self._reuse_hits,
            "claims": store["claims"],
            "aborted_requests": self._aborted,
        }

    def take_unavailable(self) -> set[str]:
        with self._lock:
            out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request) -> ProducerFinished:
        rid = request.request_id
        aborted = _ended_unread(request)
        claims = _claims_of(request)
        idents = {f.identifier for f in request.mm_features}
        with self._lock:
            self._seen.discard(rid)
            self._aborted += aborted
            for ident in [i for i, r in self._reserved.items() if rid in r.requests]:
                res = self._reserved[ident]
                res.requests.discard(rid)
                if aborted:
                    res.claims.difference_update(claims)  # on its report the store frees it unless someone claims it
                if res.requests:
                    continue
                if not res.dispatched:
                    del self._reserved[ident]
                    move(res, CopyState.FREED)
                    self.pool.free(res.slot)
                elif aborted and ident not in self._drops:
                    # Handed to the worker, maybe never encoded now: the worker drops it (or has
                    # saved it: that report comes first) and reports; the slot is freed then.
                    self._drops.append(ident)
            held = [i for i in idents if i not in self._reserved]
        if aborted:
            freed = [i for i in held if any([self.store.drop_claim(i, c) for c in claims])]  # every claim dropped
            if freed:
                logger.info("request %s ended unread: %d encoder output(s) nobody else claims freed", rid,
                            len(freed))
        items = {f.identifier: FinishedItem(f.mm_position.get_num_embeds(), f.modality) for f in request.mm_features}
        return ProducerFinished(items, self._encoder_runs.pop(rid, 0))

    def shutdown(self) -> None:
        if self._started:
            self.server.stop()
        factory.close_producers(self.pool, self._transports)


def _claims_of(request) -> tuple[str, ...]:
    """The claims of an encode request: its Encode call's (``ProducerParams``: one per reader), else its
    request id."""
    params = ProducerParams.from_dict(getattr(request, "ec_transfer_params", None))
    return params.claims or (request.request_id,)


def _ended_unread(request) -> bool:
    """The request was aborted (its Encode call cancelled or timed out) or
    failed: its caller hands its items to nobody."""

    return getattr(request, "status", None) in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class ProducerWorker:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        self.mappings = Mappings()
        self._specs: dict[str, SaveSpec] = {}
        self._notify = ""
        self._notify_key = b""
        self._sock: socket.socket | None = None  # opened by start()
        try:
            self.writes = get_tensor_model_parallel_rank() == 0  # every TP rank holds the same output
        except Exception:  # noqa: BLE001 - not initialised outside an engine
            self.writes = True

    def start(self) -> ProducerWorker:
        """Opens the socket reports go out on (once)."""
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        return self

    def begin_step(self, encoder_cache, meta: EPDConnectorMetadata) -> None:
        """Takes this step's new slots; publishes items vLLM already holds."""
        self._notify, self._notify_key = meta.notify, meta.notify_key
        for ident in meta.drops:  # never encoded: forget the slot (unless already saved and reported)
            if self._specs.pop(ident, None) is not None:
                self._report({"id": ident, "dropped": True})
        for spec in meta.saves:
            self._specs[spec.identifier] = spec
            if spec.identifier in encoder_cache:  # cached from an earlier request: no re-encode
                self.save(encoder_cache, spec.identifier)

    def save(self, encoder_cache, mm_hash: str) -> None:
        spec = self._specs.pop(mm_hash, None)
        if spec is None:
            return  # already stored on the scheduler side (a reuse), nothing reserved
        out = encoder_cache[mm_hash]
        try:
            if tuple(out.shape) != tuple(spec.shape) or tensors.dtype_name(out.dtype) != spec.dtype:
                raise ValueError(f"encoder output is {list(out.shape)} {out.dtype}, "
                                 f"slot was sized for {list(spec.shape)} {spec.dtype}")
            if self.writes and spec.nbytes and spec.cuda_ref:
                # One device-to-device copy into the exported pool, waited for.
                cuda_ipc.copy_in(transfer_pb2.CudaIpcRef.FromString(spec.cuda_ref),
                                 tensors.as_bytes(out.detach(), keep_device=True))
            elif self.writes and spec.nbytes:
                dst = self.mappings.get(spec.segment, writable=True).buffer[spec.offset: spec.offset + spec.nbytes]
                # On GPU this is the device-to-host sync the contract asks for
                # (save_caches runs right after the encoder kernel is enqueued).
                dst.copy_(tensors.as_bytes(out.detach()))
            report = {"id": mm_hash}
        except Exception as e:  # noqa: BLE001 - reported to the scheduler, never raised into vLLM
            report = {"id": mm_hash, "error": str(e)}
        self._report(report)

    def _report(self, report: dict) -> None:
        if not self.writes:
            return
        if self._sock is None:
            raise RuntimeError("ProducerWorker.start() was not called")
        try:
            self._sock.sendto(self._notify_key + json.dumps(report).encode(), self._notify)
        except OSError as e:  # the scheduler half is gone: the engine is shutting down
            logger.warning("cannot report encoder output %s: %s", report.get("id"), e)

    def build_worker_meta(self) -> None:
        return None  # reports go over the datagram socket (see the module docstring)

    def shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self.mappings.close()


