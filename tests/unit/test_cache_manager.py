"""EPDEncoderCacheManager: the seed design's two-stage allocation inside vLLM's
encoder cache (preallocate -> finalize on allocate; depreallocate; never evict
a pending preallocation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ectransfer.connector.cache_manager import EPDEncoderCacheManager, manager_for

pytestmark = pytest.mark.unit


def req(rid: str, *items: tuple[str, int]):
    feats = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(get_num_embeds=lambda n=n: n))
             for i, n in items]
    r = SimpleNamespace(request_id=rid, mm_features=feats)
    r.get_num_encoder_embeds = lambda k: feats[k].mm_position.get_num_embeds()
    return r


def cache_and_release(m: EPDEncoderCacheManager, rid: str, ident: str, n: int) -> None:
    """An entry vLLM holds for a finished request: cached, unreferenced, evictable."""
    r = req(rid, (ident, n))
    assert m.can_allocate(r, 0, 10_000, 0)
    m.allocate(r, 0)
    m.free(r)


def test_prealloc_then_allocate_is_net_zero_and_caches_the_item():
    m = EPDEncoderCacheManager(100)
    assert m.preallocate("x", 40)
    assert m.num_free_slots == 60
    r = req("r1", ("x", 40))
    assert m.can_allocate(r, 0, 10_000, 0)
    m.allocate(r, 0)  # stage 2: the reservation becomes the allocation
    assert m.num_free_slots == 60 and not m.preallocated and m.is_cached("x")


def test_prealloc_can_allocate_ignores_the_free_count_for_a_reserved_item():
    m = EPDEncoderCacheManager(100)
    assert m.preallocate("x", 90)
    assert m.can_allocate(req("r1", ("x", 90)), 0, 10_000, 0)  # its room is already taken out
    assert not m.can_allocate(req("r2", ("y", 20)), 0, 10_000, 0)  # others see only what is left


def test_prealloc_evicts_unreferenced_entries_oldest_first_when_needed():
    m = EPDEncoderCacheManager(100)
    cache_and_release(m, "old", "a", 50)
    cache_and_release(m, "newer", "b", 30)
    assert m.preallocate("x", 60)
    assert m.get_freed_mm_hashes() == ["a"] and m.is_cached("b") and not m.is_cached("a")


def test_prealloc_refused_when_nothing_can_make_room_and_nothing_changes():
    m = EPDEncoderCacheManager(100)
    r = req("live", ("busy", 80))
    m.allocate(r, 0)  # referenced by a running request: not evictable
    before = (m.num_free_slots, m.num_freeable_slots)
    assert not m.can_preallocate(30)
    assert not m.preallocate("x", 30)
    assert (m.num_free_slots, m.num_freeable_slots) == before and not m.preallocated


def test_prealloc_an_eviction_attempt_during_a_pending_preallocation_never_evicts_it():
    m = EPDEncoderCacheManager(100)
    cache_and_release(m, "old", "a", 30)
    assert m.preallocate("pending", 50)  # in flight from the encoder
    # Another request needs 60: only the unreferenced entry may go, which is not enough.
    assert not m.can_allocate(req("r2", ("big", 60)), 0, 10_000, 0)
    assert "pending" in m.preallocated and m.num_free_slots == 20
    # One that fits in free + evictable space evicts "a", never "pending".
    assert m.can_allocate(req("r3", ("mid", 40)), 0, 10_000, 0)
    assert m.get_freed_mm_hashes() == ["a"] and "pending" in m.preallocated


def test_prealloc_depreallocate_returns_the_room():
    m = EPDEncoderCacheManager(100)
    assert m.preallocate("x", 70)
    m.depreallocate("x")
    m.depreallocate("x")  # idempotent
    assert m.num_free_slots == 100 and m.num_freeable_slots == 100 and not m.preallocated


def test_prealloc_manager_is_found_by_engine_id():
    cfg = SimpleNamespace(ec_transfer_config=SimpleNamespace(engine_id="engine-xyz"))
    m = EPDEncoderCacheManager.create_manager(cache_size=10, vllm_config=cfg)
    assert manager_for("engine-xyz") is m


def test_an_external_entry_on_the_producer_is_dropped_when_its_last_request_lets_go():
    """The encoder served the item from its outbound store: vLLM allocated room nobody writes. Once
    no request holds it, it is gone (never left freeable for a later request to take as cached)."""
    m = EPDEncoderCacheManager(100)
    a, b = req("a", ("x", 30)), req("b", ("x", 30))
    assert m.can_allocate(a, 0, 10_000, 0)
    m.allocate(a, 0)
    m.mark_external("x")
    assert m.check_and_update_cache(b, 0)  # a second request in the same step shares it
    assert m.is_external("x") and m.num_free_slots == 70
    m.free(a)
    assert m.is_cached("x")  # b still holds it
    m.free(b)
    assert not m.is_cached("x") and not m.is_external("x") and "x" not in m.freeable
    assert m.num_free_slots == 100 and m.num_freeable_slots == 100 and m.get_freed_mm_hashes() == ["x"]


def test_mark_external_of_an_entry_vllm_did_not_allocate_is_ignored():
    m = EPDEncoderCacheManager(100)
    m.mark_external("x")
    assert not m.is_external("x")
