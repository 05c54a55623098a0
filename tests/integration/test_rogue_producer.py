"""The consumer against a producer that lies (tests/integration/rogue_producer.py):
a header that is not what the item's metadata promised fails that item's
request with a reason and never reaches vLLM's encoder cache; the shm probe
and in-place items only read the producer's own epd segment; an image twice in
one request is fetched once. Real gRPC, real shared memory, no vLLM engine."""

from __future__ import annotations

import os
import secrets
from types import SimpleNamespace

import pytest

from ectransfer.connector.consumer import ConsumerScheduler
from ectransfer.connector.metadata import EPDWorkerMetadata
from ectransfer.protocol import TransferState
from ectransfer.shm import ShmSegment
from epd.transfer.v1 import transfer_pb2
from tests.integration.connector_fakes import claim_of, embedding, request, schedule, steps_until
from tests.integration.rogue_producer import RogueProducer, fifo_at, release_fifo, secret_segment
from tests.support.loopback import Consumer, Producer

pytestmark = pytest.mark.integration

NB = 16 * 128 * 2  # bytes of one 16-row bfloat16 item


def fails(sched: ConsumerScheduler, req) -> bool:
    """Steps until vLLM would be told the request cannot be served."""
    rid = req.request_id
    return steps_until(lambda: (sched.ensure_cache_available(req, 0), sched.take_unavailable())[1] == {rid})


def set_shape(*dims):
    def edit(desc):
        desc.shape[:] = list(dims)
    return edit


def set_dtype(dtype):
    def edit(desc):
        desc.dtype = dtype
    return edit


@pytest.mark.parametrize("lie, reason", [
    (set_shape(32, 64), "shape"),          # same bytes, rows of the wrong width
    (set_shape(-16, -128), "negative"),    # the same product, from negative dims
    (set_dtype(transfer_pb2.FLOAT16), "dtype"),  # same itemsize, the wrong element type
], ids=["shape", "negative-dims", "dtype"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staging"])
def test_a_header_unlike_the_items_metadata_fails_its_request_and_never_reaches_the_worker(consumer, lie, reason,
                                                                                          in_place):
    rogue = RogueProducer(header=lie)
    try:
        sched = consumer(read_in_place=in_place)
        rogue.store.put("a", embedding(16, 1), claims=(claim_of("r1"),))
        req = request("r1", [("a", 16)], rogue.endpoint)
        assert fails(sched, req)
        assert not sched.has_cache_item("a")
        assert schedule(sched, req).loads == []  # nothing for vLLM's worker to inject
        error = sched.request_finished(req).error
        assert reason in error and "item a" in error, error
        assert sched.staging.stats()["used_bytes"] == 0
        assert steps_until(lambda: not rogue.store.contains("a"))  # told to let go (Cancel)
    finally:
        rogue.close()


def test_an_in_place_item_in_another_segment_is_refused_before_anything_reads_it(consumer):
    other, secret = secret_segment(f"epd-outbound-{os.getpid()}-{secrets.token_hex(4)}")

    def elsewhere(desc):
        desc.shm.segment, desc.shm.offset = other.name, 0

    rogue = RogueProducer(header=elsewhere)
    try:
        sched = consumer()
        rogue.store.put("b", embedding(16, 2), claims=(claim_of("r1"),))
        req = request("r1", [("b", 16)], rogue.endpoint)
        assert fails(sched, req)
        assert schedule(sched, req).loads == []
        assert "proved" in sched.request_finished(req).error
    finally:
        rogue.close()
        other.close()


@pytest.mark.parametrize("offset", [lambda size: size - 8, lambda size: 2**64 - 1, lambda size: 2**63],
                         ids=["past-end", "uint64-max", "int64-wrap"])
def test_an_in_place_offset_outside_the_segment_is_refused(consumer, offset):
    def out_of_range(desc):
        desc.shm.offset = offset(desc.shm.segment_nbytes)

    rogue = RogueProducer(header=out_of_range, pool_bytes=1 << 20)
    try:
        sched = consumer()
        rogue.store.put("c", embedding(16, 3), claims=(claim_of("r1"),))
        req = request("r1", [("c", 16)], rogue.endpoint)
        assert fails(sched, req)
        assert schedule(sched, req).loads == []
        assert "outside" in sched.request_finished(req).error
    finally:
        rogue.close()


def _point_probe_at(name: str):
    def edit(offer):
        if offer.transport == transfer_pb2.SHM:
            offer.shm_probe.segment, offer.shm_probe.offset, offer.shm_probe.nbytes = name, 0, 16
    return edit


def _fetch_one(rogue: RogueProducer, transports) -> tuple[Consumer, object]:
    c = Consumer(transports=transports)
    t = embedding(8, 4)
    rogue.store.put("p", t)
    transfer, _, _ = c.start(rogue.endpoint, "p", t.numel() * 2)
    return c, transfer


@pytest.mark.parametrize("kind", ["vllm-psm", "lm-staging"])
def test_a_probe_aimed_at_a_segment_that_is_not_a_producers_is_refused_and_nothing_is_read_back(kind):
    name = (f"psm_{secrets.token_hex(4)}" if kind == "vllm-psm"
            else f"epd-staging-{os.getpid()}-{secrets.token_hex(4)}")
    seg, secret = secret_segment(name)
    rogue = RogueProducer(offer=_point_probe_at(seg.name))
    forced = None
    try:
        c, transfer = _fetch_one(rogue, ("shm", "grpc"))
        try:
            assert c.wait(transfer, 10) is TransferState.LANDED  # over the chunks: shm was not proven
            assert c.client.transport_of(rogue.endpoint) == "grpc"
        finally:
            c.close()
        forced, transfer = _fetch_one(rogue, ("shm",))
        assert forced.wait(transfer, 10) is TransferState.FAILED
        assert seg.name in transfer.error and ("not an epd segment" in transfer.error or "staging" in transfer.error)
        assert not any(secret[:16] in p for p in rogue.proofs)
    finally:
        if forced is not None:
            forced.close()
        rogue.close()
        seg.close()


def test_a_probe_aimed_at_a_fifo_fails_the_handshake_instead_of_hanging_the_client():
    name = f"epd-outbound-{os.getpid()}-{secrets.token_hex(4)}"
    rogue = RogueProducer(offer=_point_probe_at(name))
    path = fifo_at(name)  # after the producer's pool is made (its orphan sweep would open it too)
    c = None
    try:
        c, transfer = _fetch_one(rogue, ("shm",))
        assert c.wait(transfer, 10) is TransferState.FAILED, "the client's loop is stuck opening the FIFO"
        assert "regular" in transfer.error
    finally:
        release_fifo(path)
        if c is not None:
            c.close()
        rogue.close()


def test_the_same_image_twice_in_one_request_is_fetched_once_and_frees_all_staging(consumer):
    producer = Producer(pool_bytes=1 << 20)
    try:
        sched = consumer()
        t = embedding(16, 5)
        producer.store.put("same", t, claims=(claim_of("r1"),))
        req = request("r1", [("same", 16), ("other", 16), ("same", 16)], producer.endpoint)
        producer.store.put("other", embedding(16, 6), claims=(claim_of("r1"),))
        assert steps_until(lambda: sched.ensure_cache_available(req, 0))
        meta = schedule(sched, req)
        assert sorted(s.identifier for s in meta.loads) == ["other", "same"]  # one load per identifier
        sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=EPDWorkerMetadata(["same", "other"])))
        sched.request_finished(req)
        assert sched.staging.stats()["used_bytes"] == 0 and sched.stats_snapshot()["pending_reservations"] == 0
        assert steps_until(lambda: producer.store.stats.acks == 2)
    finally:
        producer.close()


def test_the_same_image_twice_in_an_aborted_request_frees_all_staging(consumer):
    producer = Producer(pool_bytes=1 << 20)
    try:
        sched = consumer()
        req = request("r1", [("twice", 16), ("twice", 16)], producer.endpoint)
        assert not sched.ensure_cache_available(req, 0)  # reserved; the encode has not finished
        assert sched.staging.stats()["used_bytes"] == NB  # one copy, not two
        sched.request_finished(req)
        assert sched.staging.stats()["used_bytes"] == 0
    finally:
        producer.close()



def test_a_probe_aimed_at_another_producers_segment_teaches_the_rogue_nothing():
    """The probe can map any producer's segment (names say nothing about
    owners), so what travels back is sealed: a salted hash, never the nonce."""
    other = Producer(pool_bytes=1 << 20)
    shm = other.servicer.transports[transfer_pb2.SHM]
    probe = shm.offer().shm_probe
    seg = ShmSegment.attach(probe.segment)
    nonce = seg.buffer[probe.offset : probe.offset + probe.nbytes].numpy().tobytes()
    seg.close()

    def at_other(offer):
        if offer.transport == transfer_pb2.SHM:
            offer.shm_probe.CopyFrom(probe)

    rogue = RogueProducer(offer=at_other)
    try:
        c, transfer = _fetch_one(rogue, ("shm",))
        try:
            c.wait(transfer, 10)
        finally:
            c.close()
        assert rogue.proofs, "the consumer answered the probe"
        assert not any(nonce in p for p in rogue.proofs)
        # Forwarded to the other producer, it proves nothing: that stream's challenge differs.
        assert not any(shm.verify(p, secrets.token_bytes(16)) for p in rogue.proofs)
    finally:
        rogue.close()
        other.close()
