"""The encoder's outbound store: slots in, acks/cancels/leases free them."""

import time

import pytest
import torch
from helpers import assert_bit_identical

from ectransfer import tensors
from ectransfer.outbound import OutboundStore
from ectransfer.pool import Pool

pytestmark = pytest.mark.unit

A = 256


def make_store(capacity=16 * A, **kw):
    return OutboundStore(Pool(capacity, alignment=A), **kw)


def item_of(store, ident):
    got = []
    store.on_ready(ident, got.append)  # fires at once for a stored item
    assert len(got) == 1
    return got[0]


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


@pytest.mark.parametrize("reason, counter", [("ack", "acks"), ("cancel", "cancels"), ("expired", "expired")])
def test_release_frees_the_slot_and_counts_the_reason(reason, counter):
    store = make_store()
    store.put("a", torch.ones(100))
    assert used(store) == 2 * A
    assert store.release("a", reason) is True
    assert getattr(store.stats, counter) == 1
    assert used(store) == 0 and store.pool.stats()["allocations"] == 0
    assert not store.contains("a")
    assert store.release("a", reason) is False  # exactly once
    assert getattr(store.stats, counter) == 1


def test_begin_and_end_send_track_readers():
    store = make_store()
    store.put("a", torch.ones(3))
    assert store.begin_send("missing") is None
    item = store.begin_send("a")
    assert item.sending == 1 and store.begin_send("a").sending == 2
    store.end_send(item)
    store.end_send(item)
    assert item.sending == 0
    store.release("a", "ack")
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
    store.on_ready("later", calls.append)
    store.on_ready("later", lambda item: calls.append(("second", item.identifier)))
    assert calls == []
    store.put("later", torch.ones(2))
    assert [getattr(c, "identifier", c) for c in calls] == ["later", ("second", "later")]
    store.put("later", torch.ones(2))  # a reuse does not fire the waiters again
    assert len(calls) == 2
    store.on_ready("later", calls.append)
    assert len(calls) == 3 and calls[-1].identifier == "later"


def test_forget_waiter_removes_only_that_callback():
    store = make_store()
    kept, dropped = [], []
    store.on_ready("a", kept.append)
    store.on_ready("a", dropped.append)
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
    store.on_ready("b", waiter.append)
    assert store.put("b", torch.ones(1)) is False
    assert store.stats.items_dropped == 1 and store.stats.items_put == 1
    assert not store.contains("b") and waiter == []
    assert store.pool.stats()["allocations"] == 1
    store.release("a", "ack")
    assert store.put("b", torch.ones(1)) is True
    assert waiter and waiter[0].identifier == "b"


def test_an_item_larger_than_the_pool_is_dropped_at_once():
    store = make_store(capacity=A, put_timeout_s=30.0)
    assert store.put("huge", torch.ones(A)) is False  # 1 KiB never fits 256 bytes
    assert store.stats.items_dropped == 1 and used(store) == 0


def test_stats_aggregate_adds_fieldwise():
    a, b = make_store(), make_store()
    a.put("x", torch.ones(1))
    a.release("x", "ack")
    b.put("y", torch.ones(1))
    b.put("y", torch.ones(1))
    total = a.stats.aggregate(b.stats)
    assert (total.items_put, total.items_reused, total.acks, total.cancels) == (2, 1, 1, 0)


def test_stale_cancel_after_ack_does_not_drop_the_next_copy():
    """A consumer's late Cancel for an item it already acked must not make the
    store drop the next publication of the same item (another LM needs it)."""
    store = make_store()
    store.put("a", torch.ones(4))
    assert store.release("a", "ack")
    assert store.release("a", "cancel") is False  # stale: that copy is gone
    store.expect("a")  # the encoder reserved a new copy for another request
    store.put("a", torch.ones(4))
    assert store.contains("a") and store.stats.cancels == 0


def test_cancel_before_the_first_copy_still_frees_it_on_arrival():
    store = make_store()
    store.release("b", "cancel")  # the consumer gave up before the encode finished
    store.expect("b")
    store.put("b", torch.ones(4))
    assert not store.contains("b") and store.stats.cancels == 1


def test_failed_item_forgets_its_cancel():
    store = make_store()
    store.release("c", "cancel")
    store.mark_failed("c", "encoder error")
    store.put("c", torch.ones(4))  # a later encode of the same image is kept
    assert store.contains("c")


def test_a_release_while_another_consumer_reads_frees_the_slot_after_the_last_reader():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.arange(64, dtype=torch.float32))
    used = pool.stats()["used_bytes"]
    reader = store.begin_send("a")  # consumer B reads the slot (chunks, or in place)
    assert store.release("a", "ack")  # consumer A's ack
    assert not store.contains("a") and store.begin_send("a") is None  # gone for new readers
    assert pool.stats()["used_bytes"] == used  # but B's bytes stay put
    store.end_send(reader)
    assert pool.stats()["used_bytes"] == 0


def test_a_new_copy_replacing_one_being_read_waits_for_the_reader():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.zeros(64))
    reader = store.begin_send("a")
    slot = pool.alloc(256)
    pool.view(slot).fill_(7)
    used = pool.stats()["used_bytes"]
    store.adopt("a", slot, (64,), torch.float32)
    assert pool.stats()["used_bytes"] == used  # the old copy's slot is still allocated for its reader...
    assert pool.view(reader.slot).eq(0).all()  # ...and intact
    store.end_send(reader)
    assert pool.stats()["used_bytes"] == slot.nbytes


def test_an_in_place_reader_that_goes_away_restarts_the_lease():
    store = OutboundStore(Pool(1 << 16), ttl_s=10)
    store.put("a", torch.zeros(4))
    item = store.begin_send("a")
    store.expire(now=time.monotonic() + 100)
    assert store.contains("a")  # held: never expired
    store.end_send(item, restart_lease=True)
    assert store.expire(now=time.monotonic() + 5) == []
    assert store.expire(now=time.monotonic() + 11) == ["a"]


def test_a_released_copy_whose_in_place_reader_went_away_is_kept_for_a_lease():
    pool = Pool(1 << 16)
    store = OutboundStore(pool, ttl_s=10)
    store.put("a", torch.zeros(64))
    reader = store.begin_send("a")  # an LM reads it in place; its stream then closes
    store.release("a", "ack")  # another LM's ack
    store.end_send(reader, restart_lease=True)  # its worker may still be copying
    assert pool.stats()["used_bytes"] > 0
    store.expire(now=time.monotonic() + 5)
    assert pool.stats()["used_bytes"] > 0
    store.expire(now=time.monotonic() + 11)
    assert pool.stats()["used_bytes"] == 0


def test_a_late_ack_for_a_copy_already_freed_does_not_free_the_newer_copy():
    pool = Pool(1 << 16)
    store = OutboundStore(pool)
    store.put("a", torch.zeros(64))
    old = store.begin_send("a")
    store.release("a", "ack")  # another LM's ack frees copy 1 (after our read ends)
    store.put("a", torch.ones(64))  # copy 2, for a third LM
    assert not store.release("a", "ack", held=old)  # our late ack names copy 1
    assert store.contains("a")
    store.end_send(old)


def test_a_cancel_between_two_copies_frees_the_next_copy_soon_unless_someone_reads_it():
    pool = Pool(1 << 16)
    store = OutboundStore(pool, ttl_s=60)
    store.put("a", torch.zeros(4))
    store.release("a", "ack")  # copy 1 done
    store.release("a", "cancel")  # "not needed": stale for copy 1, or meant for copy 2?
    store.put("a", torch.zeros(4))  # copy 2 arrives with nobody waiting
    assert store.contains("a")  # a consumer may still ask for it...
    store.expire(now=time.monotonic() + store.stale_cancel_grace_s / 2)
    assert store.contains("a")
    store.expire(now=time.monotonic() + store.stale_cancel_grace_s + 1)
    assert not store.contains("a") and store.stats.cancels == 1  # ...nobody did: freed, not leased a minute


def test_a_copy_read_after_a_late_cancel_is_kept_for_its_reader():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4))
    store.release("a", "ack")
    store.release("a", "cancel")
    store.put("a", torch.zeros(4))
    item = store.begin_send("a")  # another LM asks for it
    store.end_send(item)
    store.expire(now=time.monotonic() + store.stale_cancel_grace_s + 1)
    assert store.contains("a")  # its Ack frees it, not the late cancel


def test_each_cancel_drops_one_copy_also_when_several_come_before_their_copies():
    """An LM that has the image cached answers two requests before either encode
    ends: two Cancels, then two copies one after the other. Each copy is for
    nobody; neither may stay for a lease."""
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.release("a", "cancel")
    store.release("a", "cancel")
    store.put("a", torch.zeros(4))
    assert not store.contains("a")
    store.put("a", torch.zeros(4))
    assert not store.contains("a") and store.stats.cancels == 2
    store.put("a", torch.zeros(4))  # a third copy had no cancel: kept for its reader
    assert store.contains("a")


def test_each_late_cancel_frees_one_later_copy_soon():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4))
    store.release("a", "ack")
    store.release("a", "cancel")
    store.release("a", "cancel")
    for _ in range(2):
        store.put("a", torch.zeros(4))
        store.expire(now=time.monotonic() + store.stale_cancel_grace_s + 1)
        assert not store.contains("a")
    assert store.stats.cancels == 2


def test_a_cancel_is_forgotten_after_cancel_memory_s():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.cancel_memory_s = 0.05
    store.release("a", "cancel")
    time.sleep(0.1)
    store.put("a", torch.zeros(4))  # the cancel was for an encode that never made a copy
    assert store.contains("a")


def test_a_cancel_while_a_consumer_reads_the_copy_is_for_the_next_copy():
    """Request 1's LM reads copy 1 in place; request 2's LM, with the image
    cached, cancels before request 2's copy exists. Copy 1 stays for its reader;
    copy 2, wanted by nobody, is freed soon instead of held for a lease."""
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4))
    first = store.begin_send("a")
    assert store.release("a", "cancel") is False
    assert store.contains("a")
    store.end_send(first)
    assert store.release("a", "ack", held=first)
    store.put("a", torch.zeros(4))  # copy 2
    store.expire(now=time.monotonic() + store.stale_cancel_grace_s + 1)
    assert not store.contains("a") and store.stats.cancels == 1 and store.stats.acks == 1


def test_the_readers_own_cancel_still_frees_the_copy_it_read():
    store = OutboundStore(Pool(1 << 16), ttl_s=60)
    store.put("a", torch.zeros(4))
    item = store.begin_send("a")  # an in-place reader's pin
    assert store.release("a", "cancel", held=item)  # its request was aborted
    store.end_send(item)
    assert not store.contains("a") and store.pool.stats()["used_bytes"] == 0


def test_cancel_records_are_bounded_per_item_and_in_total_and_evictions_are_logged(caplog):
    store = make_store(max_cancel_records=10, max_cancels_per_item=3)
    with caplog.at_level("WARNING", logger="ectransfer.outbound"):
        for i in range(1000):  # Cancels of items never encoded here: each is kept for a copy to come
            store.release(f"nobody-{i}", "cancel")
        for _ in range(1000):
            store.release("same", "cancel")
    assert store.cancel_records() == 9 + 3  # the 9 newest random identifiers, 3 cancels of "same"
    assert any("cancel records full" in r.getMessage() for r in caplog.records)
    store.put("same", torch.ones(3))  # each remembered cancel still drops one copy
    assert not store.contains("same") and store.cancel_records() == 9 + 2
