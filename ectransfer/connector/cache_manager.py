"""``EPDEncoderCacheManager``: vLLM's encoder cache manager with the seed
design's two-stage allocation, plugged in with::

    --ec-manager-config '{"encoder_cache_manager_cls":
                          "ectransfer.connector.cache_manager.EPDEncoderCacheManager"}'

Stage 1, ``preallocate``: when the consumer connector starts fetching an item
from an encoder, it reserves the item's embeddings in vLLM's encoder cache, so
a landed item always has room (the fetch waits instead when the cache is
full). Stage 2, ``finalize_allocation``: when vLLM's scheduler allocates the
item for its request (``allocate``), the reservation becomes that allocation,
net zero. ``depreallocate`` returns a reservation whose fetch failed or was
cancelled. A preallocated item is never in ``freeable``, so it is never evicted.

On an encoder (the producer), an item its outbound store holds (the host tier,
or a copy another request claimed) is an external load too: the connector's
``has_cache_item`` says yes, vLLM skips the vision run and allocates room for
an output nobody writes into this engine's worker. ``mark_external`` records
such an entry; it is dropped whole the moment its last request lets go of it
(never left freeable, where a later request would find an output the worker
does not have).

The scheduler and the connector's scheduler half share one process; the
connector finds this manager through ``manager_for(engine_id)``. Called only on
vLLM's scheduler thread: no locks.
"""

from __future__ import annotations

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

_MANAGERS: dict[str, EPDEncoderCacheManager] = {}

EC_MANAGER_CONFIG = {"encoder_cache_manager_cls": "ectransfer.connector.cache_manager.EPDEncoderCacheManager"}
"""vLLM's ``ec_manager_config`` that plugs this manager in (both services pass it)."""


def _nothing_in_flight(identifier: str) -> bool:
    return False


def manager_for(engine_id: str) -> EPDEncoderCacheManager | None:
    return _MANAGERS.get(engine_id)


class EPDEncoderCacheManager(EncoderCacheManager):
    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config) -> EPDEncoderCacheManager:
        manager = cls(cache_size=cache_size)
        if vllm_config.ec_transfer_config is not None:
            _MANAGERS[vllm_config.ec_transfer_config.engine_id] = manager
        return manager

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        self.preallocated: dict[str, int] = {}  # mm_hash -> embeddings reserved
        self.external: set[str] = set()  # producer: allocated for items the connector holds, never written
        self.in_flight = _nothing_in_flight
        """Consumer: set by its connector half (``ConsumerScheduler.in_flight``): items it fetches that have
        not landed. vLLM computes a prompt up to such an item and no further (``can_allocate``)."""

    def reset(self) -> None:
        super().reset()
        self.preallocated.clear()
        self.external.clear()

    def mark_external(self, mm_hash: str) -> None:
        """Producer: vLLM just allocated ``mm_hash`` as an external load (the connector holds its output; the
        worker never gets it)."""
        if mm_hash in self.cached:
            self.external.add(mm_hash)

    def is_external(self, mm_hash: str) -> bool:
        return mm_hash in self.external

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.cached

    def can_preallocate(self, num_embeds: int) -> bool:
        return num_embeds <= self.num_freeable_slots  # free now, or after evicting unreferenced entries

    def preallocate(self, mm_hash: str, num_embeds: int) -> bool:
        """Stage 1. Reserves room (evicting unreferenced entries, oldest first,
        as vLLM would); False if it cannot, and nothing changes."""
        if mm_hash in self.preallocated:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            evicted, n = self.freeable.popitem(last=False)
            del self.cached[evicted]
            del self.num_embeds_by_hash[evicted]
            self.freed.append(evicted)
            self.num_free_slots += n
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds
        self.preallocated[mm_hash] = num_embeds
        return True

    def depreallocate(self, mm_hash: str) -> None:
        n = self.preallocated.pop(mm_hash, None)
        if n is not None:
            self.num_free_slots += n
            self.num_freeable_slots += n

    def finalize_allocation(self, mm_hash: str) -> None:
        """Stage 2: hands the reservation to vLLM's own allocation (net zero)."""
        self.depreallocate(mm_hash)

    # -- vLLM's hooks -----------------------------------------------------------

    def can_allocate(self, request, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int) -> bool:
        """No for an item in flight: vLLM's scheduler then computes the tokens just before it (as when its
        cache is full), and the item's own tokens once it has landed."""
        if self.in_flight(request.mm_features[input_id].identifier):
            return False
        if request.mm_features[input_id].identifier in self.preallocated:
            return request.get_num_encoder_embeds(input_id) <= encoder_compute_budget  # room is reserved
        return super().can_allocate(request, input_id, encoder_compute_budget, num_embeds_to_schedule)

    def allocate(self, request, input_id: int) -> None:
        self.finalize_allocation(request.mm_features[input_id].identifier)
        super().allocate(request, input_id)

    def free_encoder_input(self, request, input_id: int) -> None:
        super().free_encoder_input(request, input_id)
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash in self.external and mm_hash in self.freeable:  # nobody uses it: drop it, never reuse it
            self.external.discard(mm_hash)
            n = self.freeable.pop(mm_hash)
            del self.cached[mm_hash]
            self.num_embeds_by_hash.pop(mm_hash, None)
            self.num_free_slots += n
            self.freed.append(mm_hash)
