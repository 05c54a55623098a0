"""Consumer halves (LM engine, ``ec_role=ec_consumer``).

Scheduler half (vLLM's scheduler thread): for each request whose
``ec_transfer_params`` (``ECTransferParams``) name an encoder, ``ensure_cache_available`` reserves
inbound staging and asks the encoder for each item; ``has_cache_item`` says yes for landed
items so vLLM loads them instead of encoding; ``update_state_after_alloc``
queues the load; the worker's report frees the staging slot.

Prefill in step with arrival (``prefill_in_step``, on by default): a request is deferred only while its
next item to compute has not landed. Until then vLLM computes its prompt up to that item and stops there:
our ``EPDEncoderCacheManager.can_allocate`` says no for an item in flight (``in_flight``), which is the
rule vLLM's scheduler already follows when its encoder cache is full (it schedules the tokens just before
the item). Items are fetched in prompt order, so the first land first. Off: the request waits until every
item has landed (``prefill_ahead_tokens`` counts the prompt tokens computed while an item of the same
request was still in flight).

Ownership: a staging slot is allocated here and freed here, exactly once, when
the worker injected it, the transfer failed, or no request needs it any more.

Worker half: copies each item into vLLM's encoder cache on the worker's
device, with the producer's dtype and shape: straight from the encoder's
memory when the transport reads in place (shm: one memcpy or H2D copy; CUDA
IPC: one device-to-device copy), else from the staging the gRPC chunks landed
in. In-place items stay held by the encoder until the worker's report reaches
the scheduler half, which then acks them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ectransfer import factory, tensors
from ectransfer.base import ConsumerTransport
from ectransfer.client import TransferClient
from ectransfer.connector.cache_manager import manager_for
from ectransfer.connector.common import compat_for, worker_device
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.metadata import (
    ConsumerFinished,
    ECTransferParams,
    EPDConnectorMetadata,
    EPDWorkerMetadata,
    ItemSource,
    LoadSpec,
    TransferReport,
)
from ectransfer.peer_session import Fetch
from ectransfer.pool import Slot
from ectransfer.protocol import ItemTransfer, TransferState
from ectransfer.shm import Mappings, ShmPool
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig

logger = logging.getLogger(__name__)

_INJECTED_MEMORY = 4096  # identifiers remembered as already in vLLM's encoder cache


@dataclass
class _Inbound:
    transfer: ItemTransfer
    endpoint: str
    slot: Slot | None  # inbound staging; None once the item landed in place (no staging needed)
    fetch: Fetch
    requests: set[str] = field(default_factory=set)
    owner: str = ""  # the request whose claim this fetch reads under
    claim: str = ""  # that request's claim (ItemSource.claim)
    others: list[tuple[str, str]] = field(default_factory=list)
    """(endpoint, claim) of the other requests that share this fetch or found the item cached
    meanwhile: each Encode claimed a copy; their claims are cancelled when this item is done
    (after its ack), so those copies are freed without waiting out a lease."""


@dataclass
class _RequestStats:
    local_encoder_runs: int = 0
    transferred_items: int = 0
    wait_started: float = 0.0
    transfer_ms: float = 0.0


_IN_FLIGHT = (TransferState.RESERVED, TransferState.RECEIVING)
_READY = (TransferState.LANDED, TransferState.LOADING)  # vLLM may be told it is cached


class ConsumerScheduler:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        engine_id = vllm_config.ec_transfer_config.engine_id
        # Shared memory because vLLM's worker may be another process (it is on CPU).
        self.staging = ShmPool(cfg.staging_bytes, role="staging")
        transports = [factory.make_consumer(n) for n in factory.resolve(cfg.transports, "consumer")]
        self._transports = {t.name: t for t in transports}
        self.client = TransferClient(
            compat_for(vllm_config, cfg.model_name),
            consumer_id=engine_id,
            transports=transports,
            timeout_s=cfg.transfer_timeout_s,
            hold_s=cfg.in_place_hold_s,
            security=SecurityConfig.from_dict(cfg.security),
        )
        self.engine_id = engine_id
        self._manager = None  # EPDEncoderCacheManager, when configured (created after us)
        self._items: dict[str, _Inbound] = {}
        self._progress = threading.Event()  # set by the transfer thread on every item transition
        self._injected: OrderedDict[str, None] = OrderedDict()
        self._skipped: dict[str, set[str]] = {}  # request -> items it told the encoder it does not need
        self._errors: dict[str, str] = {}  # request -> why its encoder outputs cannot be had
        self._failed_endpoints: dict[str, set[str]] = defaultdict(set)  # request -> encoders that failed it
        self._to_load: list[LoadSpec] = []
        self._unmap_next: list[tuple[str, str]] = []
        self._unavailable: set[str] = set()
        self._stats: dict[str, _RequestStats] = defaultdict(_RequestStats)
        self._counts = {"cancels": 0, "failed": 0, "reuse_hits": 0, "prefill_ahead_tokens": 0}
        self._ahead: set[str] = set()  # requests let compute this step while an item of theirs is in flight
        self._generator_offsets = worker_device().type != "cpu"  # see _may_compute_part_of
        self._encoder_decoder = bool(getattr(vllm_config.model_config, "is_encoder_decoder", False))
        self._loading: dict[str, int] = defaultdict(int)  # request -> items queued for load this step

    # -- scheduling -----------------------------------------------------------

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        rid = request.request_id
        try:
            sources = ECTransferParams.from_dict(request.ec_transfer_params).items
        except ValueError as e:  # never raised into vLLM's step: the request fails instead
            logger.error("request %s: malformed ec_transfer_params: %s", rid, e)
            self._errors[rid] = f"malformed ec_transfer_params: {e}"
            self._unavailable.add(rid)
            return False
        if not sources:
            return True
        # vLLM computes a request's last prompt token whatever its caches or a KV connector hold (its
        # logits give the first output token): an item covering that token is needed even when the count
        # says the whole prompt is computed (a decode LM's KV loaded from a prefill LM).
        n_prompt = getattr(request, "num_prompt_tokens", None)
        if n_prompt and not getattr(request, "num_output_tokens", 0):
            num_computed_tokens = min(num_computed_tokens, n_prompt - 1)
        stats = self._stats[rid]
        if not stats.wait_started:
            stats.wait_started = time.monotonic()
        skipped = self._skipped.setdefault(rid, set())
        # One copy per identifier: an image that appears twice in the prompt is
        # fetched (and its staging reserved and freed) once, under its first
        # placeholder still to compute; it is cancelled only if no placeholder needs it.
        needed: dict[str, tuple[int, Any, ItemSource]] = {}
        not_needed: dict[str, ItemSource] = {}
        for index, feat in enumerate(request.mm_features):
            src = sources.get(feat.identifier)
            if src is None:
                continue  # no encoder named: vLLM encodes it here
            if not _embeds_from(feat.mm_position, num_computed_tokens) or self._in_vllm_cache(feat.identifier):
                not_needed.setdefault(feat.identifier, src)
            else:
                needed.setdefault(feat.identifier, (index, feat, src))
        for ident, src in not_needed.items():
            # The prefix cache covers it, or vLLM's encoder cache holds it:
            # settle this request's claim (the encoder frees its copy unless another claims it).
            if ident not in needed and ident not in skipped:
                skipped.add(ident)
                self._counts["reuse_hits"] += self._in_vllm_cache(ident)
                inbound = self._items.get(ident)
                if inbound is not None:  # another request's fetch of it is in flight: after that one
                    self._share(inbound, rid, src)
                else:
                    self.client.cancel(src.endpoint, ident, src.claim)
                    self._counts["cancels"] += 1
        missing = [n for ident, n in needed.items() if ident not in self._items]
        if missing and not self._start_all(request, missing):
            return False
        ready = True
        first_in_flight = None  # the prompt position of the first item this request still waits for
        for _, feat, src in needed.values():
            item = self._items[feat.identifier]
            if rid != item.owner and rid not in item.requests:
                # This request shares another's fetch: its own claim is settled once the shared
                # item is done.
                self._share(item, rid, src)
            item.requests.add(rid)
            # Landed in place, then its stream closed: failed here, on the scheduler's thread.
            if item.transfer.state is TransferState.LOST:
                item.transfer.try_advance(TransferState.FAILED)
            state = item.transfer.state
            if state is TransferState.FAILED:
                self._fail(item)
                return False
            if state not in _READY:
                ready = False
                if first_in_flight is None or feat.mm_position.offset < first_in_flight:
                    first_in_flight = feat.mm_position.offset
        if ready:
            if not stats.transfer_ms:
                stats.transfer_ms = (time.monotonic() - stats.wait_started) * 1e3
            return True
        if (self.cfg.prefill_in_step and first_in_flight > num_computed_tokens and self._cache_manager() is not None
                and self._may_compute_part_of(request)):
            # Tokens before that item can be computed now; the manager stops vLLM at the item.
            self._ahead.add(rid)
            return True
        return False

    def _may_compute_part_of(self, request) -> bool:
        """Whether vLLM's worker can compute part of this request's prompt in a step. Not for a request with
        its own seed on a device whose random generator has no offset (CPU): for a step that ends inside the
        prompt, vLLM 0.32's model runner winds the request's generator back (``_bookkeeping_sync``:
        ``gen.set_offset(gen.get_offset() - 4)``) and a CPU generator raises ("CPU Generator does not use
        offset"), which kills the engine. Such a request waits for all its items, as before."""
        params = getattr(request, "sampling_params", None)
        return getattr(params, "seed", None) is None or self._generator_offsets


    def _start_all(self, request, missing) -> bool:
        """Reserves staging for every missing item of ``request`` or for none
        (two requests never hold half the staging each), then asks the encoders.
        Each item must arrive as the metadata promised: ``[num_embeds,
        embed_width]`` (num_embeds from the prompt's placeholder) in ``dtype``;
        the transfer client refuses any other header."""
        kinds = [((request.get_num_encoder_embeds(index), src.embed_width), tensors.dtype_from_name(src.dtype))
                 for index, _, src in missing]
        sizes = [tensors.nbytes_of(shape, dtype) for shape, dtype in kinds]
        if sum(sizes) > self.staging.capacity:
            msg = (f"the request's encoder outputs need {sum(sizes)} bytes, more than the LM's staging "
                   f"({self.staging.capacity} bytes; raise --staging-mib)")
            logger.error("request %s: %s", request.request_id, msg)
            self._errors[request.request_id] = msg
            self._unavailable.add(request.request_id)
            return False
        slots = []
        manager = self._cache_manager()
        for (index, feat, _), n in zip(missing, sizes):
            slot = self.staging.try_alloc(n)
            # Stage 1 of the two-stage allocation: room in vLLM's encoder cache too.
            if slot is not None and manager is not None and not manager.preallocate(
                    feat.identifier, request.get_num_encoder_embeds(index)):
                self.staging.free(slot)
                slot = None
            if slot is None:  # full: wait for other requests to drain (backpressure)
                for (_, taken_feat, _), taken in zip(missing, slots):
                    self.staging.free(taken)
                    if manager is not None:
                        manager.depreallocate(taken_feat.identifier)
                return False
            slots.append(slot)
        for (_, feat, src), slot, n, (shape, dtype) in zip(missing, slots, sizes, kinds):
            transfer = ItemTransfer(feat.identifier, n, on_change=self._progress.set)
            fetch = self.client.fetch(transfer, src.endpoint, self.staging.view(slot), request.request_id,
                                      in_place=self.cfg.read_in_place, shape=shape, dtype=dtype, claim=src.claim)
            self._items[feat.identifier] = _Inbound(transfer, src.endpoint, slot, fetch, owner=request.request_id,
                                                    claim=src.claim)
        return True

    def _share(self, item: _Inbound, rid: str, src: ItemSource) -> None:
        if (src.endpoint, src.claim) != (item.endpoint, item.claim) and (src.endpoint, src.claim) not in item.others:
            item.others.append((src.endpoint, src.claim))

    def _fail(self, item: _Inbound) -> None:
        logger.error("requests %s cannot get item %s: %s", sorted(item.requests),
                     item.transfer.identifier, item.transfer.error)
        self._unavailable |= item.requests
        self._counts["failed"] += 1
        for rid in item.requests:
            self._errors[rid] = item.transfer.error or "the encoder output could not be obtained"
            self._failed_endpoints[rid].add(item.endpoint)
        self._drop(item)

    def _cache_manager(self):
        if self._manager is None:
            self._manager = manager_for(self.engine_id) or False
            if self._manager:
                self._manager.in_flight = self.in_flight
        return self._manager or None

    def in_flight(self, identifier: str) -> bool:
        """Whether this half fetches ``identifier`` and it has not landed yet (vLLM must not compute past
        its placeholder: ``EPDEncoderCacheManager.can_allocate``)."""
        item = self._items.get(identifier)
        return item is not None and item.transfer.state not in _READY

    def _in_vllm_cache(self, ident: str) -> bool:
        """Whether vLLM's encoder cache holds the item (exact with our cache
        manager; otherwise what we injected recently, which eviction may undo:
        then vLLM encodes it locally, correct but slower). Never for an encoder-decoder model: vLLM's
        ``EncoderDecoderCacheManager`` shares no output between requests (``check_and_update_cache`` is
        always False; each request's output is freed after its step), so a window another request had
        injected is fetched again."""
        if self._encoder_decoder:
            return False
        manager = self._cache_manager()
        return manager.is_cached(ident) if manager is not None else ident in self._injected

    def _drop(self, item: _Inbound) -> None:
        if self._items.pop(item.transfer.identifier, None) is not None:
            for endpoint, claim in item.others:  # after this item's own ack or cancel
                self.client.cancel(endpoint, item.transfer.identifier, claim)
                self._counts["cancels"] += 1
            item.others = []
            self._free_staging(item)
            manager = self._cache_manager()
            if manager is not None and item.transfer.state is not TransferState.DONE:
                manager.depreallocate(item.transfer.identifier)  # never injected: give the room back

    def _free_staging(self, item: _Inbound) -> None:
        if item.slot is not None:
            self.staging.free(item.slot)
            item.slot = None

    def has_cache_item(self, identifier: str) -> bool:
        """Whether vLLM loads ``identifier`` from us instead of encoding it. Never for an encoder-decoder
        model: vLLM sizes a request's cross-attention blocks only over the inputs it encodes itself, so the
        item takes vLLM's local path and is loaded all the same (``update_state_after_alloc``, which vLLM
        calls for every input it allocates); the worker's runner hands the landed output to the decoder
        instead of encoding (``ectransfer.connector.encoder_decoder``). The request is held until the
        output has landed (``ensure_cache_available``: its item sits at token 0)."""
        if self._encoder_decoder:
            return False
        item = self._items.get(identifier)
        return item is not None and item.transfer.state in _READY

    def update_state_after_alloc(self, request, index: int) -> None:
        item = self._items.get(request.mm_features[index].identifier)
        if item is None:
            return
        fetch = item.fetch
        with item.transfer.hold():  # atomic with the client's demote: from LOADING on it leaves it alone
            if not item.transfer.try_advance(TransferState.LOADING):  # queued already, or not landed
                return
            src = fetch.source
        dtype = tensors.dtype_name(fetch.dtype)
        if src is None:  # bytes in our staging
            spec = LoadSpec(item.transfer.identifier, fetch.shape, dtype, self.staging.name, item.slot.offset,
                            item.slot.nbytes)
        else:  # in place: the worker copies from the encoder's memory, we ack after
            self._free_staging(item)
            memory, offset = fetch.transport.where(src)
            spec = LoadSpec(item.transfer.identifier, fetch.shape, dtype, memory, offset, src.nbytes,
                            transport=fetch.transport.name, source=src.SerializeToString())
        self._to_load.append(spec)
        self._stats[request.request_id].transferred_items += 1
        self._loading[request.request_id] += 1
        # Settled for this request: once injected, vLLM's cache holds it, and a later
        # ensure_cache_available must not mistake that for a hit and Cancel an item
        # this request already acked (the encoder would keep the stale cancel and
        # drop the next publication of the same image, which another LM may need).
        self._skipped.setdefault(request.request_id, set()).add(item.transfer.identifier)

    def build_meta(self, scheduler_output) -> EPDConnectorMetadata:
        for req_id, inputs in scheduler_output.scheduled_encoder_inputs.items():
            # An encoder-decoder model's loaded inputs are scheduled as local ones (has_cache_item).
            self._stats[req_id].local_encoder_runs += len(inputs) - (self._loading[req_id] if self._encoder_decoder else 0)
        self._loading.clear()
        if self._ahead:  # this step's: ensure_cache_available runs again before each step
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            self._counts["prefill_ahead_tokens"] += sum(scheduled.get(rid, 0) for rid in self._ahead)
            self._ahead.clear()
        # Process-wide mappings (CUDA IPC: the client's probe, maybe a worker
        # here): this process's copy is closed a step after the worker was told.
        for name, memory in self._unmap_next:
            transport = self._transports.get(name)
            if transport is not None and transport.shared_mappings:
                transport.forget(memory)
        self._wait_if_idle(scheduler_output)
        meta = EPDConnectorMetadata(loads=self._to_load, unmap=self.client.take_unmapped())
        self._unmap_next = meta.unmap
        self._to_load = []
        return meta

    def _wait_if_idle(self, scheduler_output) -> None:
        """A step with nothing to compute while items are in flight: vLLM would
        step again in 1 ms and call the worker every time, so wait here for the
        transfer thread's next event (an item landed or failed), at most
        ``idle_wait_s``."""
        self._progress.clear()  # before the check: an event after it ends the wait
        if self._to_load or scheduler_output.total_num_scheduled_tokens or self.cfg.idle_wait_s <= 0:
            return
        if any(it.transfer.state in _IN_FLIGHT for it in self._items.values()):
            self._progress.wait(self.cfg.idle_wait_s)

    def update_connector_output(self, output) -> None:
        meta = output.ec_connector_worker_meta
        if not isinstance(meta, EPDWorkerMetadata):
            return
        for ident in meta.loaded:
            item = self._items.get(ident)
            if item is not None:
                if item.fetch.source is not None:  # read in place: now the encoder may free it
                    self.client.ack(item.endpoint, ident, item.claim, item.fetch.copy)
                item.transfer.try_advance(TransferState.DONE)
                self._drop(item)  # then the claims of the requests that shared it
            self._injected[ident] = None
            self._injected.move_to_end(ident)
            while len(self._injected) > _INJECTED_MEMORY:
                self._injected.popitem(last=False)

    def stats_snapshot(self) -> dict[str, Any]:
        pool = self.staging.stats()
        pending = [i for i in self._items.values() if i.transfer.state not in _READY]
        return {
            "role": "consumer",
            "pool_capacity_bytes": pool["capacity_bytes"],
            "pool_used_bytes": pool["used_bytes"],
            "reserved_bytes": sum(i.slot.nbytes for i in pending if i.slot is not None),
            "pending_reservations": len(self._items),
            "cancels": self._counts["cancels"],
            "failed": self._counts["failed"],
            "reuse_hits": self._counts["reuse_hits"],
            "prefill_ahead_tokens": self._counts["prefill_ahead_tokens"],
        }

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request) -> ConsumerFinished:
        rid = request.request_id
        for item in list(self._items.values()):
            item.requests.discard(rid)
            if not item.requests and item.transfer.state is not TransferState.LOADING:
                with item.transfer.hold():  # atomic with the client's demote
                    state = item.transfer.state
                    in_place = item.fetch.source is not None
                    item.transfer.try_advance(TransferState.CANCELLED)  # terminal: the client leaves it alone
                # Landed in staging: acked already. Landed in place (or lost): the encoder
                # still holds it for us, so it is cancelled like one in flight.
                if not state.terminal and (state is not TransferState.LANDED or in_place):
                    self.client.cancel(item.endpoint, item.transfer.identifier, item.claim, item.fetch.copy)
                self._drop(item)
        self._skipped.pop(rid, None)
        error = self._errors.pop(rid, "")
        failed = tuple(sorted(self._failed_endpoints.pop(rid, ())))  # the gateway re-encodes these elsewhere
        stats = self._stats.pop(rid, None)
        report = None
        if stats is not None and request.mm_features:
            transports = {}
            if stats.transferred_items:  # what the engine negotiated with each encoder (params parsed before)
                endpoints = ECTransferParams.from_dict(request.ec_transfer_params).endpoints()
                transports = {e: self.client.transport_of(e) for e in endpoints}
            report = TransferReport(stats.local_encoder_runs, stats.transferred_items, stats.transfer_ms, transports)
        return ConsumerFinished(error, failed, report)

    def start(self) -> ConsumerScheduler:
        """Starts the transfer client's thread (the facade calls this once vLLM built the half)."""
        self.client.start()
        return self

    def shutdown(self) -> None:
        self.client.close()
        self.staging.close()


class ConsumerWorker:
    def __init__(self, vllm_config, cfg: ConnectorConfig) -> None:
        # The scheduler half's staging, mapped once; the encoders' memory is
        # read in place by one transport object per name (``_reader``), which
        # maps each encoder's once and unmaps it when its stream closes.
        self.mappings = Mappings()
        self._readers: dict[str, ConsumerTransport] = {}
        self._loaded: list[str] = []

    def _reader(self, name: str) -> ConsumerTransport:
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = factory.make_consumer(name)
        return reader

    def load(self, encoder_cache, meta: EPDConnectorMetadata) -> None:
        device = worker_device()
        for spec in meta.loads:
            if spec.identifier in encoder_cache:
                self._loaded.append(spec.identifier)
                continue
            dtype = tensors.dtype_from_name(spec.dtype)
            if spec.transport:
                # Out of the encoder's memory, finished before the scheduler half acks (it frees the range).
                raw = self._reader(spec.transport).load(transfer_pb2.TensorDescriptor.FromString(spec.source), device)
                encoder_cache[spec.identifier] = tensors.from_bytes(raw, spec.shape, dtype)
            else:
                raw = self.mappings.get(spec.segment).buffer[spec.offset : spec.offset + spec.nbytes]
                # A copy (one memcpy / H2D): the slot is freed once the scheduler hears back.
                encoder_cache[spec.identifier] = tensors.from_bytes(raw, spec.shape, dtype).to(device, copy=True)
            self._loaded.append(spec.identifier)
        for name, memory in meta.unmap:
            self._reader(name).forget(memory)

    def start(self) -> ConsumerWorker:
        return self  # nothing to start: mappings open on first use

    def shutdown(self) -> None:
        self.mappings.close()
        for reader in self._readers.values():
            reader.close()

    def build_worker_meta(self) -> EPDWorkerMetadata | None:
        if not self._loaded:
            return None
        meta, self._loaded = EPDWorkerMetadata(self._loaded), []
        return meta


def _embeds_from(pos, num_computed_tokens: int) -> bool:
    """Whether the placeholder ``pos`` (vLLM ``PlaceholderRange``) has an embedding row at or after token
    ``num_computed_tokens``: vLLM's scheduler runs (or loads) an encoder input only then, by this same rule
    (``get_embeds_indices_in_range`` over the tokens still to compute)."""
    start = max(0, num_computed_tokens - pos.offset)
    if start >= pos.length:
        return False
    first, end = pos.get_embeds_indices_in_range(start, pos.length)
    return end > first
