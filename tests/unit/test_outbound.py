"""The encoder's outbound store: copies held for claims; acks, cancels, aborts and leases free them."""

import time

import pytest
import torch

from ectransfer import tensors
from ectransfer.outbound import OutboundStore
from ectransfer.pool import Pool
from tests.unit.helpers import assert_bit_identical

pytestmark = pytest.mark.unit

A = 256


def make_store(capacity=16 * A, **kw):
    return OutboundStore(Pool(capacity, alignment=A), **kw)


def item_of(store, ident):
    item = store.held(ident)
    assert item is not None
    return item


def used(store):
    return store.pool.stats()["used_bytes"]


def test_put_copies_the_tensor_into_a_slot():
    store = make_store()
    t = torch.randn(4, 10).to(torch.bfloat16)
    original = t.clone()
    assert store.put("a", t)
    t.zero_()  # the store holds its own copy
    item = item_of(store, "a")
    assert (item.identifier, item.shape, item.dtype, item.slot.nbytes) == ("a", (4, 10), torch.bfloat16, 80)
    assert store.contains("a") and not store.contains("b")
    assert store.stats.items_put == 1
    assert used(store) == A
    assert_bit_identical(tensors.from_bytes(store.view(item), item.shape, item.dtype), original)


def test_put_of_a_non_contiguous_tensor_stores_its_logical_bytes():
    store = make_store()
    t = torch.arange(48, dtype=torch.float32).reshape(6, 8).t()
    store.put("a", t)
    item = item_of(store, "a")
    assert_bit_identical(tensors.from_bytes(store.view(item), item.shape, item.dtype), t)


def _settle(store, reason, claim):
    if reason == "ack":
        return store.ack("a", claim)
    if reason == "cancel":
        return store.cancel("a", claim)
    if reason == "abort":
        return store.drop_claim("a", claim)
    return bool(store.expire(now=time.monotonic() + store.ttl_s + 1))


@pytest.mark.parametrize("reason, counter", [("ack", "acks"), ("cancel", "cancels"), ("abort", "cancels"),
                                             ("expired", "expired")])
def test_settling_the_last_claim_frees_the_slot_and_counts_the_reason(reason, counter):
    store = make_store()
    store.put("a", torch.ones(100), claims=("e1",))
    assert used(store) == 2 * A
    assert _settle(store, reason, "e1") is True
    assert getattr(store.stats, counter) == 1
    assert used(store) == 0 and store.pool.stats()["allocations"] == 0
    assert not store.contains("a")
    assert _settle(store, reason, "e1") is False  # exactly once
    assert getattr(store.stats, counter) == 1


def test_a_copy_is_held_until_every_claim_on_it_is_settled():
    store = make_store()
    store.put("a", torch.ones(4), claims=("e1",))
    assert store.claim("a", "e2")  # a second Encode of the same image reuses the copy
    assert store.ack("a", "e1") is False and store.contains("a")  # e2's LM has not read it yet
    assert store.ack("a", "e1") is False and store.contains("a")  # a repeated Ack changes nothing
    assert store.cancel("a", "someone-else") is False and store.contains("a")  # nor another claim's Cancel
    assert store.ack("a", "e2") is True and not store.contains("a")


def test_begin_and_end_send_track_readers():
    store = make_store()
    store.put("a", torch.ones(3))
    assert store.begin_send("missing") is None
    item = store.begin_send("a")
    assert item.readers == 1 and store.begin_send("a").readers == 2
    store.end_send(item)
    store.end_send(item)
    assert item.readers == 0
    store.ack("a")
    snap = store.snapshot()
    assert snap["items"] == 0 and snap["acks"] == 1 and snap["items_put"] == 1 and snap["used_bytes"] == 0


def test_putting_an_existing_identifier_reuses_it_without_allocating():
    store = make_store()
    store.put("a", torch.ones(10))
    assert store.put("a", torch.zeros(10)) is True
    assert store.stats.items_reused == 1 and store.stats.items_put == 1
    assert store.pool.stats()["allocations"] == 1
    item = item_of(store, "a")
    assert torch.equal(tensors.from_bytes(store.view(item), item.shape, item.dtype), torch.ones(10))


def test_on_ready_fires_at_once_when_present_and_on_put_otherwise():
    store = make_store()
    calls = []
    store.on_ready("later", "c1", calls.append)
    store.on_ready("later", "c2", lambda item: calls.append(("second", item.identifier)))
    assert calls == []
    store.put("later", torch.ones(2), claims=())  # nobody's Encode claims it, but two consumers wait
    assert [getattr(c, "identifier", c) for c in calls] == ["later", ("second", "later")]
    assert item_of(store, "later").claims == {"c1", "c2"}  # held for the waiters
    store.put("later", torch.ones(2))  # a reuse does not fire the waiters again
    assert len(calls) == 2
    store.on_ready("later", "c3", calls.append)
    assert len(calls) == 3 and calls[-1].identifier == "later"


def test_forget_waiter_removes_only_that_callback():
    store = make_store()
    kept, dropped = [], []
    store.on_ready("a", "c1", kept.append)
    store.on_ready("a", "c2", dropped.append)
    store.forget_waiter("a", dropped.append)
    store.forget_waiter("never-registered", dropped.append)  # a no-op
    store.put("a", torch.ones(2))
    assert len(kept) == 1 and dropped == []


def test_expire_frees_only_old_items_nobody_is_sending():
    store = make_store(ttl_s=60.0)
    for ident in ("old", "busy", "young", "edge"):
        store.put(ident, torch.ones(1))
    item_of(store, "old").created = 100.0
    item_of(store, "busy").created = 100.0
    item_of(store, "young").created = 150.0
    item_of(store, "edge").created = 140.0  # exactly ttl old at now=200: kept
    busy = store.begin_send("busy")
    assert store.expire(now=200.0) == ["old"]
    assert store.stats.expired == 1 and used(store) == 3 * A
    store.end_send(busy)
    assert store.expire(now=200.0) == ["busy"]
    assert sorted(store.expire(now=1000.0)) == ["edge", "young"]
    assert store.stats.expired == 4 and used(store) == 0


def test_put_on_a_full_pool_drops_the_item_after_the_timeout():
    store = make_store(capacity=A, put_timeout_s=0.01)
    assert store.put("a", torch.ones(64))  # 256 bytes: the whole pool
    waiter = []
    store.on_ready("b", "c", waiter.append)
    assert store.put("b", torch.ones(1)) is False
    assert store.stats.items_dropped == 1 and store.stats.items_put == 1
    assert not store.contains("b") and waiter == []
    assert store.pool.stats()["allocations"] == 1
    store.ack("a")
    assert store.put("b", torch.ones(1)) is True
    assert waiter and waiter[0].identifier == "b"


def test_an_item_larger_than_the_pool_is_dropped_at_once():
    store = make_store(capacity=A, put_timeout_s=30.0)
    assert store.put("huge", torch.ones(A)) is False  # 1 KiB never fits 256 bytes
    assert store.stats.items_dropped == 1 and used(store) == 0


def test_stats_aggregate_adds_fieldwise():
    a, b = make_store(), make_store()
    a.put("x", torch.ones(1))
    a.ack("x")
    b.put("y", torch.ones(1))
    b.put("y", torch.ones(1))
    total = a.stats.aggregate(b.stats)
    assert (total.items_put, total.items_reused, total.acks, total.cancels) == (2, 1, 1, 0)


def test_a_stale_cancel_after_the_ack_does_not_drop_the_next_copy():
    """An LM's late Cancel for a claim it already acked settles nothing new: the
    next copy, made for another Encode's claim, is kept for that claim's LM."""
    store = make_store()
    store.put("a", torch.ones(4), claims=("e1",))
    assert store.ack("a", "e1")
    assert store.cancel("a", "e1") is False  # stale: that copy is gone
    store.put("a", torch.ones(4), claims=("e2",))  # another request's encode
    assert store.contains("a") and store.stats.cancels == 0


def test_a_cancel_before_the_copy_exists_frees_it_on_arrival():
    store = make_store()
    store.cancel("b", "e1")  # the LM found the image cached before the encode finished
    assert store.claim("b", "e1")  # the encode's claim comes later: already settled, no copy needed
    store.put("b", torch.ones(4), claims=("e1",))  # a copy made for it anyway (reserved earlier)
    assert not store.contains("b") and store.stats.cancels == 1


def test_a_failed_item_keeps_later_claims():
    store = make_store()
    store.cancel("c", "e1")
    store.mark_failed("c", "encoder error")
    store.put("c", torch.ones(4), claims=("e2",))  # a later encode of the same image is kept
    assert store.contains("c")


def test_an_ack_while_another_consumer_reads_frees_the_slot_after_the_last_reader():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.arange(64, dtype=torch.float32), claims=("ea", "eb"))
    used_before = pool.stats()["used_bytes"]
    reader = store.begin_send("a", "eb")  # consumer B reads the slot (chunks, or in place)
    assert store.ack("a", "ea") is False  # consumer A's ack: B's claim still holds it
    assert store.cancel("a", "eb") is False  # B's own cancel while it reads: unclaimed, not freed
    assert pool.stats()["used_bytes"] == used_before  # B's bytes stay put
    store.end_send(reader)
    assert pool.stats()["used_bytes"] == 0 and not store.contains("a")


def test_a_second_copy_adopted_while_one_is_held_is_merged_into_it():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.zeros(64), claims=("e1",))
    reader = store.begin_send("a", "e1")
    slot = pool.alloc(256)
    used_before = pool.stats()["used_bytes"]
    assert store.adopt("a", slot, (64,), torch.float32, claims=("e2",)) is reader  # one copy per identifier
    assert pool.stats()["used_bytes"] == used_before - slot.nbytes  # the new slot went at once
    assert reader.claims == {"e1", "e2"} and pool.view(reader.slot).eq(0).all()
    store.end_send(reader)
    store.ack("a", "e1", reader.copy)
    assert store.contains("a")
    store.ack("a", "e2", reader.copy)
    assert pool.stats()["used_bytes"] == 0


def test_an_in_place_reader_that_goes_away_restarts_the_lease():
    store = OutboundStore(Pool(1 << 16), ttl_s=10)
    store.put("a", torch.zeros(4))
    item = store.begin_send("a")
    store.expire(now=time.monotonic() + 100)
    assert store.contains("a")  # read: never expired
    store.end_send(item, lost=True)
    assert store.expire(now=time.monotonic() + 5) == []
    assert store.expire(now=time.monotonic() + 11) == ["a"]


def test_an_unclaimed_copy_whose_in_place_reader_went_away_is_kept_for_a_lease():
    pool = Pool(1 << 16)
    store = OutboundStore(pool, ttl_s=10)
    store.put("a", torch.zeros(64), claims=("ea", "eb"))
    reader = store.begin_send("a", "eb")  # an LM reads it in place; its stream then closes
    store.ack("a", "ea")  # the other LM's ack
    store.cancel("a", "eb")  # and, say, a cancel that raced the stream's end
    store.end_send(reader, lost=True)  # its worker may still be copying
    assert pool.stats()["used_bytes"] > 0
    store.expire(now=time.monotonic() + 5)
    assert pool.stats()["used_bytes"] > 0
    store.expire(now=time.monotonic() + 11)
    assert pool.stats()["used_bytes"] == 0


def test_a_late_ack_naming_a_copy_already_freed_does_not_free_the_newer_copy():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.zeros(64), claims=("e1", "e2"))
    old = store.begin_send("a", "e1")
    store.end_send(old)
    store.ack("a", "e2")
    store.ack("a", "e1", old.copy)  # copy 1 freed
    store.put("a", torch.ones(64), claims=("e3",))  # copy 2, for a third LM
    newer = store.held("a")
    assert newer.copy != old.copy
    assert not store.ack("a", "e1", old.copy)  # a repeated late ack of copy 1
    assert store.contains("a") and store.held("a") is newer


def test_a_cancel_between_two_copies_settles_only_its_own_claim():
    """Claims make the old guess (is this Cancel stale, or for the next copy?) unnecessary."""
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4), claims=("e1",))
    store.ack("a", "e1")  # copy 1 done
    store.cancel("a", "e2")  # request 2's LM had the image cached: its encode's copy is for nobody
    store.put("a", torch.zeros(4), claims=("e2",))  # copy 2 arrives: freed at once
    assert not store.contains("a") and store.stats.cancels == 1
    store.put("a", torch.zeros(4), claims=("e3",))  # copy 3, claimed by a live request: kept
    assert store.contains("a")


def test_a_copy_read_by_a_consumer_whose_claim_was_not_registered_is_kept_for_it():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4), claims=("e1",))
    item = store.begin_send("a", "e9")  # an LM reads under a claim the producer has not seen yet
    store.ack("a", "e1")
    store.end_send(item)
    assert store.contains("a")  # its Ack frees it
    assert store.ack("a", "e9", item.copy) and not store.contains("a")


def test_each_cancel_drops_its_own_copy_also_when_several_come_before_their_copies():
    """An LM that has the image cached answers two requests before either encode
    ends: two Cancels, then two copies one after the other. Each copy is for
    nobody; neither may stay for a lease; a third request's copy is kept."""
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.cancel("a", "e1")
    store.cancel("a", "e2")
    store.put("a", torch.zeros(4), claims=("e1",))
    assert not store.contains("a")
    store.put("a", torch.zeros(4), claims=("e2",))
    assert not store.contains("a") and store.stats.cancels == 2
    store.put("a", torch.zeros(4), claims=("e3",))
    assert store.contains("a")


def test_a_cancel_while_a_consumer_reads_the_copy_is_for_its_own_claim():
    """Request 1's LM reads the copy in place; request 2's LM, with the image
    cached, cancels request 2's claim on the same copy. The copy stays for its
    reader and goes with request 1's Ack."""
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4), claims=("e1", "e2"))
    first = store.begin_send("a", "e1")
    assert store.cancel("a", "e2") is False
    assert store.contains("a")
    store.end_send(first)
    assert store.ack("a", "e1", first.copy)
    assert not store.contains("a") and store.stats.acks == 1 and store.stats.cancels == 0


def test_the_readers_own_cancel_still_frees_the_copy_it_read():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4), claims=("e1",))
    item = store.begin_send("a", "e1")  # an in-place reader's pin
    assert store.cancel("a", "e1") is False  # its request was aborted; it still reads
    store.end_send(item)
    assert not store.contains("a") and store.pool.stats()["used_bytes"] == 0


def test_the_anonymous_claim_is_never_remembered_as_settled():
    store = make_store()
    store.put("a", torch.ones(4))
    assert store.ack("a")
    assert not store.settled("a", "")
    store.put("a", torch.ones(4))  # a peer naming no claim gets the next copy held
    assert store.contains("a")


def test_settled_claim_records_are_bounded_and_evictions_are_logged(caplog):
    store = make_store(max_settled_claims=10)
    with caplog.at_level("WARNING", logger="ectransfer.outbound"):
        for i in range(1000):  # Cancels of claims never seen here
            store.cancel(f"nobody-{i}", f"e{i}")
    assert store.settled_records() == 10
    assert any("settled-claim records full" in r.getMessage() for r in caplog.records)
    assert store.settled("nobody-999", "e999") and not store.settled("nobody-0", "e0")


def test_an_illegal_transition_raises_in_tests():
    from ectransfer.outbound import CopyState, IllegalTransition, move

    store = make_store()
    store.put("a", torch.ones(4))
    item = store.held("a")
    store.ack("a")
    assert item.state is CopyState.FREED
    with pytest.raises(IllegalTransition, match="FREED -> HELD"):
        move(item, CopyState.HELD)


# -- the host tier (keep_bytes > 0) --------------------------------------------------------------------


def _put(store, ident, claim="c"):
    assert store.put(ident, torch.zeros(A // 4, dtype=torch.float32), (claim,))  # one slot of A bytes


def test_a_settled_copy_is_kept_and_the_next_encode_claims_it_back():
    store = make_store(keep_bytes=2 * A)
    _put(store, "a")
    assert store.ack("a", "c")  # released: no claim holds it any more
    item = item_of(store, "a")
    assert item.state.name == "KEPT" and store.kept() == (1, A) and used(store) == A
    assert store.snapshot()["items"] == 0 and store.snapshot()["tier_items"] == 1
    assert store.expire(now=time.monotonic() + 3600) == []  # no lease in the tier
    assert store.claim("a", "next")  # a tier hit: no new slot
    assert item_of(store, "a") is item and item.state.name == "HELD" and store.kept() == (0, 0)
    assert store.stats.tier_hits == 1 and used(store) == A
    store.cancel("a", "next")
    assert item.state.name == "KEPT"


def test_the_tier_evicts_its_least_recently_used_copy_past_its_bytes():
    store = make_store(keep_bytes=2 * A)
    for ident in "abc":
        _put(store, ident)
    g = store.generation
    store.ack("a", "c")
    store.ack("b", "c")
    store.claim("a", "again")  # a is used again: b is now the oldest kept once a comes back
    store.ack("a", "again")
    store.ack("c", "c")  # three kept copies do not fit in 2 slots' bytes: b goes
    assert not store.contains("b") and store.contains("a") and store.contains("c")
    assert store.kept() == (2, 2 * A) and used(store) == 2 * A and store.stats.tier_evictions == 1
    assert store.generation > g and sorted(store.identifiers()[1]) == ["a", "c"]


def test_a_reservation_that_does_not_fit_evicts_kept_copies_first():
    store = make_store(capacity=4 * A, keep_bytes=4 * A)
    for ident in "abcd":
        _put(store, ident)
        store.ack(ident, "c")
    assert store.kept() == (4, 4 * A) and store.pool.try_alloc(A) is None
    slot = store.try_alloc(2 * A)  # evicts a and b, the oldest
    assert slot is not None and not store.contains("a") and not store.contains("b") and store.contains("c")
    store.pool.free(slot)
    with pytest.raises(Exception, match="never fit"):
        store.try_alloc(8 * A)
    assert store.clear_tier() == 2 and used(store) == 0


def test_a_copy_whose_claims_settled_before_it_landed_goes_to_the_tier():
    store = make_store(keep_bytes=A)
    store.cancel("a", "c")  # the LM had it in its prefix cache before the encode ended
    slot = store.pool.alloc(A)
    item = store.adopt("a", slot, (A // 4,), torch.float32, ("c",))
    assert item is not None and item.state.name == "KEPT" and store.kept() == (1, A)


def test_a_copy_larger_than_the_tier_is_freed_as_without_one():
    store = make_store(keep_bytes=A // 2)
    _put(store, "a")
    assert store.ack("a", "c") and not store.contains("a") and used(store) == 0


def test_a_kept_copy_read_under_a_settled_claim_is_not_evicted_while_read():
    store = make_store(capacity=2 * A, keep_bytes=2 * A)
    _put(store, "a")
    store.ack("a", "c")
    item = store.begin_send("a", "c")  # the same (settled) claim reads it again
    assert item.state.name == "UNCLAIMED" and store.kept() == (0, 0)
    assert store.try_alloc(2 * A) is None  # nothing to evict: a is being read
    store.end_send(item)
    assert item.state.name == "KEPT"
