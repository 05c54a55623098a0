"""The connector's scheduler and worker halves under every ordering the seed
design names: request before/after the encode, abort during transfer, cancel
because of the prefix cache, full pools on either side, lease expiry, reuse.
Real gRPC, real shared memory, no vLLM engine (tests/integration/connector_fakes.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
from ectransfer.connector.producer import ProducerScheduler, ProducerWorker
from tests.integration.connector_fakes import claim_of, embedding, request, schedule, steps_until, vllm_config
from tests.support.loopback import Producer

pytestmark = pytest.mark.integration

NB = 16 * 128 * 2  # bytes of one 16-row item


def inject(sched: ConsumerScheduler, req, meta=None) -> dict:
    """What vLLM does once ensure_cache_available says yes: allocate, load, report."""
    cache: dict = {}
    meta = schedule(sched, req) if meta is None else meta
    worker = ConsumerWorker(vllm_config("lm-1"), sched.cfg)
    worker.load(cache, meta)
    sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=worker.build_worker_meta()))
    worker.shutdown()
    return cache


def used(sched: ConsumerScheduler) -> int:
    return sched.staging.stats()["used_bytes"]


def test_prealloc_request_before_encode_lands_exactly_and_frees_staging(producer, consumer):
    sched = consumer()
    req = request("r1", [("a", 16)], producer.endpoint)
    assert not sched.ensure_cache_available(req, 0)  # reserved, asked, nothing encoded yet
    assert used(sched) == NB
    t = embedding(16, 1)
    producer.store.put("a", t, claims=(claim_of("r1"),))  # the encode finishes after the request arrived
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    cache = inject(sched, req)
    assert torch.equal(cache["a"].view(torch.int16), t.view(torch.int16))
    assert used(sched) == 0
    assert steps_until(lambda: not producer.store.contains("a"))  # acked
    assert sched.request_finished(req).report.transferred_items == 1


def test_prealloc_encode_before_request(producer, consumer):
    sched = consumer()
    producer.store.put("b", embedding(16, 2), claims=(claim_of("r1"),))
    req = request("r1", [("b", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    assert "b" in inject(sched, req)


def test_prealloc_abort_during_transfer_releases_both_sides(producer, consumer):
    sched = consumer()
    req = request("r1", [("c", 16)], producer.endpoint)
    assert not sched.ensure_cache_available(req, 0)
    sched.request_finished(req)  # the client went away while the encode runs
    assert used(sched) == 0
    # the Cancel reaches the encoder before its output does
    assert steps_until(lambda: producer.store.settled("c", claim_of("r1")))
    producer.store.put("c", embedding(16, 3), claims=(claim_of("r1"),))
    assert not producer.store.contains("c") and producer.store.stats.cancels == 1


def test_prealloc_cancel_because_the_prefix_cache_covers_the_item(producer, consumer):
    sched = consumer()
    producer.store.put("d", embedding(16, 4), claims=(claim_of("r1"),))
    req = request("r1", [("d", 16)], producer.endpoint)
    covered = req.mm_features[0].mm_position.offset + req.mm_features[0].mm_position.length
    assert sched.ensure_cache_available(req, covered)  # nothing to fetch
    assert used(sched) == 0
    assert steps_until(lambda: not producer.store.contains("d"))  # "not needed" freed it
    assert producer.store.stats.cancels == 1


def test_two_requests_share_one_fetch_and_the_second_ones_own_copy_is_cancelled_after_the_load(producer, consumer):
    """r2 (same image, its own encode) arrives while r1's copy is in flight: it shares r1's fetch.
    The copy r2's encode makes after r1's was acked would wait out its lease (nobody asks for it):
    the LM cancels it once the shared copy is loaded."""
    sched = consumer()
    r1, r2 = request("r1", [("s", 16)], producer.endpoint), request("r2", [("s", 16)], producer.endpoint)
    assert not sched.ensure_cache_available(r1, 0)
    assert not sched.ensure_cache_available(r2, 0)  # shares r1's fetch: no second reserve
    producer.store.put("s", embedding(16, 9), claims=(claim_of("r1"),))  # r1's copy
    assert steps_until(lambda: sched.ensure_cache_available(r1, 0) and sched.ensure_cache_available(r2, 0))
    inject(sched, r1)
    assert steps_until(lambda: not producer.store.contains("s"))  # r1's copy acked
    producer.store.put("s", embedding(16, 9), claims=(claim_of("r2"),))  # r2's encode ends now: a second copy
    assert steps_until(lambda: not producer.store.contains("s"))  # cancelled, not held for a lease
    assert producer.store.stats.acks == 1 and producer.store.stats.expired == 0
    sched.request_finished(r1)
    sched.request_finished(r2)
    assert used(sched) == 0


def test_backpressure_staging_full_defers_whole_requests_then_proceeds(producer, consumer):
    sched = consumer(staging_bytes=NB + 512)  # room for one item
    producer.store.put("e1", embedding(16, 5), claims=(claim_of("r1"),))
    producer.store.put("e2", embedding(16, 6), claims=(claim_of("r2"),))
    r1 = request("r1", [("e1", 16)], producer.endpoint)
    r2 = request("r2", [("e2", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(r1, 0))
    assert not sched.ensure_cache_available(r2, 0)  # waits; reserves nothing
    assert used(sched) == NB
    inject(sched, r1)
    sched.request_finished(r1)
    assert steps_until(lambda: sched.ensure_cache_available(r2, 0))
    assert "e2" in inject(sched, r2)


def test_backpressure_a_request_larger_than_staging_fails_cleanly_with_a_reason(producer, consumer):
    sched = consumer(staging_bytes=NB // 2)
    req = request("r1", [("f", 16)], producer.endpoint)
    assert not sched.ensure_cache_available(req, 0)
    assert sched.take_unavailable() == {"r1"}
    assert "staging" in sched.request_finished(req).error


def test_lease_an_item_nobody_produces_fails_its_request_with_a_reason(consumer):
    p = Producer(item_wait_s=0.3)
    sched = consumer()
    try:
        req = request("r1", [("never", 16)], p.endpoint)
        assert steps_until(lambda: (sched.ensure_cache_available(req, 0), sched.take_unavailable())[1] == {"r1"})
        assert used(sched) == 0
        assert "not encoded" in sched.request_finished(req).error
    finally:
        p.close()


def test_lease_an_unacked_outbound_item_is_reclaimed():
    p = Producer(ttl_s=0.2)
    try:
        p.store.put("g", embedding(16, 7))
        assert steps_until(lambda: not p.store.contains("g"))
        assert p.store.stats.expired == 1 and p.pool.stats()["allocations"] == 1  # only the shm nonce
    finally:
        p.close()


def test_reuse_an_item_in_vllms_encoder_cache_is_not_transferred_again(producer, consumer):
    sched = consumer()
    producer.store.put("h", embedding(16, 8), claims=(claim_of("r1"),))
    r1 = request("r1", [("h", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(r1, 0))
    inject(sched, r1)
    producer.store.put("h", embedding(16, 8), claims=(claim_of("r2"),))  # the encoder published it again for r2
    r2 = request("r2", [("h", 16)], producer.endpoint)
    assert sched.ensure_cache_available(r2, 0)  # at once: no transfer
    assert used(sched) == 0
    assert steps_until(lambda: not producer.store.contains("h"))  # and the encoder was told


def test_prealloc_producer_halves_reserve_save_and_serve(producer, consumer):
    """ProducerScheduler + ProducerWorker: reserve at schedule time, the worker
    writes the slot and reports over the datagram socket, Transfer serves it."""
    cfg = ConnectorConfig(outbound_pool_bytes=3 * NB, model_name="test-model")
    ps = ProducerScheduler(vllm_config("enc-1"), cfg).start()
    pw = ProducerWorker(vllm_config("enc-1"), cfg).start()
    sched = consumer()
    try:
        endpoint = f"127.0.0.1:{ps.server.bound_port}"
        r1 = request("e1", [("p1", 16), ("p2", 16)])
        r2 = request("e2", [("p3", 16), ("p4", 16)])
        assert ps.ensure_cache_available(r1, 0)
        assert not ps.ensure_cache_available(r2, 0)  # backpressure: the pool holds 2 items + the nonce
        meta = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={"e1": [0, 1]}, total_num_scheduled_tokens=0))
        outputs = {"p1": embedding(16, 11), "p2": embedding(16, 12)}
        pw.begin_step(outputs, meta)  # neither is cached yet
        for ident in ("p1", "p2"):
            pw.save(outputs, ident)  # vLLM calls this right after each encode
        assert steps_until(lambda: ps.store.contains("p1") and ps.store.contains("p2"))
        assert ps.request_finished(r1).encoder_runs == 2
        req = request("l1", [("p1", 16), ("p2", 16)], endpoint, claim="e1")  # what r1's Encode sent
        assert steps_until(lambda: sched.ensure_cache_available(req, 0))
        cache = inject(sched, req)
        assert all(torch.equal(cache[i].view(torch.int16), outputs[i].view(torch.int16)) for i in outputs)
        assert steps_until(lambda: ps.ensure_cache_available(r2, 0))  # acks freed the pool
    finally:
        pw.shutdown()
        ps.shutdown()


def test_prealloc_fetches_reserve_vllm_cache_room_first_and_return_it_on_failure():
    from ectransfer.connector.cache_manager import EPDEncoderCacheManager
    from tests.integration.connector_fakes import vllm_config as fake_config

    p = Producer(item_wait_s=0.5)
    manager = EPDEncoderCacheManager.create_manager(cache_size=20, vllm_config=fake_config("lm-prealloc"))
    cfg = ConnectorConfig(staging_bytes=1 << 20, transfer_timeout_s=10, model_name="test-model")
    sched = ConsumerScheduler(fake_config("lm-prealloc"), cfg).start()
    try:
        r1 = request("r1", [("z1", 16)], p.endpoint)
        r2 = request("r2", [("z2", 16)], p.endpoint)
        at = r1.mm_features[0].mm_position.offset  # the text before the item computed: the item is next
        assert not sched.ensure_cache_available(r1, at)
        assert manager.preallocated == {"z1": 16}
        assert not sched.ensure_cache_available(r2, at)  # backpressure: vLLM's cache has room for one
        assert "z2" not in manager.preallocated and used(sched) == NB
        # z1 is never encoded: its request fails and both reservations come back.
        assert steps_until(lambda: (sched.ensure_cache_available(r1, at), sched.take_unavailable())[1] == {"r1"})
        assert manager.preallocated == {} and manager.num_free_slots == 20 and used(sched) == 0
        sched.request_finished(r1)
        p.store.put("z2", embedding(16, 9), claims=(claim_of("r2"),))
        assert steps_until(lambda: sched.ensure_cache_available(r2, at))  # now it fits
        assert manager.preallocated == {"z2": 16}
    finally:
        sched.shutdown()
        p.close()


def test_in_place_the_worker_reads_the_encoders_segment_and_the_ack_follows_the_load(producer, consumer):
    sched = consumer(in_place_hold_s=60)  # not moved to staging while the test runs, however slow the host
    t = embedding(16, 21)
    producer.store.put("i1", t, claims=(claim_of("r1"),))
    req = request("r1", [("i1", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    meta = schedule(sched, req)
    (spec,) = meta.loads
    assert spec.segment == producer.pool.name  # the encoder's memory, no staging copy
    assert used(sched) == 0
    time.sleep(0.1)
    assert producer.store.contains("i1") and producer.store.stats.acks == 0  # held for the read
    cache = inject(sched, req, meta)
    assert torch.equal(cache["i1"].view(torch.int16), t.view(torch.int16))
    assert steps_until(lambda: producer.store.stats.acks == 1 and not producer.store.contains("i1"))


def test_in_place_off_lands_in_staging_and_acks_at_once(producer, consumer):
    sched = consumer(read_in_place=False)
    t = embedding(16, 22)
    producer.store.put("i2", t, claims=(claim_of("r1"),))
    req = request("r1", [("i2", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    assert steps_until(lambda: producer.store.stats.acks == 1)  # before any load
    meta = schedule(sched, req)
    assert meta.loads[0].segment == sched.staging.name
    assert torch.equal(inject(sched, req, meta)["i2"].view(torch.int16), t.view(torch.int16))


def test_in_place_a_request_that_ends_before_its_load_cancels_the_hold(producer, consumer):
    sched = consumer(in_place_hold_s=60)  # not moved to staging (and acked) before the request ends
    producer.store.put("i3", embedding(16, 23), claims=(claim_of("r1"),))
    req = request("r1", [("i3", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    sched.request_finished(req)  # aborted after landing, before vLLM scheduled it
    assert steps_until(lambda: producer.store.stats.cancels == 1 and not producer.store.contains("i3"))
    assert producer.pool.stats()["allocations"] == 1  # only the shm nonce


def test_in_place_an_encoder_that_goes_away_before_the_load_fails_the_request_and_unmaps():
    from tests.integration.connector_fakes import vllm_config as fake_config

    p = Producer(pool_bytes=1 << 20)
    # A long hold: the item stays in the encoder's memory (not moved to staging) until the encoder goes.
    sched = ConsumerScheduler(fake_config("lm-1"), ConnectorConfig(model_name="test-model",
                                                                   in_place_hold_s=60)).start()
    try:
        p.store.put("i4", embedding(16, 24), claims=(claim_of("r1"),))
        req = request("r1", [("i4", 16)], p.endpoint)
        assert steps_until(lambda: sched.ensure_cache_available(req, 0))
        segment = p.pool.name
        p.close()  # the stream closes: the encoder no longer holds i4 for us
        assert steps_until(lambda: (sched.ensure_cache_available(req, 0), sched.take_unavailable())[1] == {"r1"})
        assert not sched.has_cache_item("i4")
        assert ("shm", segment) in sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0)).unmap
        assert sched.request_finished(req).error
    finally:
        sched.shutdown()


def test_in_place_an_item_vllm_does_not_take_in_time_moves_to_staging_and_frees_the_encoder(producer, consumer):
    sched = consumer(in_place_hold_s=0.3)
    t = embedding(16, 25)
    producer.store.put("i5", t, claims=(claim_of("r1"),))
    req = request("r1", [("i5", 16)], producer.endpoint)
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    # vLLM keeps the request waiting (no KV space): the encoder's pool must not stay pinned.
    assert steps_until(lambda: producer.store.stats.acks == 1 and not producer.store.contains("i5"))
    meta = schedule(sched, req)
    assert meta.loads[0].segment == sched.staging.name  # loaded from staging now
    assert torch.equal(inject(sched, req, meta)["i5"].view(torch.int16), t.view(torch.int16))
    assert used(sched) == 0


def test_malformed_ec_transfer_params_fail_the_request_without_dialing_or_raising(consumer):
    sched = consumer()
    req = request("r1", [("a", 16)])
    req.ec_transfer_params = {"items": {"a": {"endpoint": "enc-1:5000", "embed_width": "128", "dtype": "bfloat16"}}}
    assert not sched.ensure_cache_available(req, 0)  # refused, not raised into vLLM's step
    assert sched.take_unavailable() == {"r1"}
    assert used(sched) == 0 and not sched.has_cache_item("a")
    assert "embed_width" in sched.request_finished(req).error
