"""The Transfer protocol over real gRPC on loopback with real shared memory."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch

from ectransfer import tensors
from ectransfer.protocol import TransferState
from epd.transfer.v1 import transfer_pb2
from tests.integration.connector_fakes import steps_until
from tests.support.loopback import Consumer, Producer, compat

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def producer():
    p = Producer()
    yield p
    p.close()


def random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = (rng.randint(0, 300), rng.choice([1, 64, 128, 1024]))
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=torch.Generator().manual_seed(rng.randint(0, 2**31)))
    if dtype == torch.float32:
        return torch.cat([bits, bits], dim=-1).view(torch.float32) if shape[0] else torch.empty(shape, dtype=dtype)
    return bits.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(tensors.as_bytes(a), tensors.as_bytes(b))


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_many_random_tensors_arrive_bit_identical_and_free_the_producer_slot(producer, transport):
    consumer = Consumer(transports=(transport,))
    rng = random.Random(7)
    baseline = producer.pool.stats()["used_bytes"]  # the shm transport's nonce slot
    try:
        for i in range(60):
            t = random_tensor(rng)
            producer.store.put(f"item-{i}", t)
            transfer, got = consumer.get(producer.endpoint, f"item-{i}", t.numel() * t.element_size())
            assert transfer.state is TransferState.LANDED, transfer.error
            assert same_bits(got, t)
        steps_until(lambda: producer.pool.stats()["used_bytes"] == baseline)  # acks travel asynchronously
        assert producer.pool.stats()["used_bytes"] == baseline
        assert producer.store.stats.acks == 60
    finally:
        consumer.close()


def test_a_reserve_waits_for_an_item_encoded_later(producer):
    consumer = Consumer()
    try:
        t = torch.randn(16, 128).to(torch.bfloat16)
        transfer, fetch, slot = consumer.start(producer.endpoint, "late", 16 * 128 * 2)
        time.sleep(0.2)
        assert transfer.state is TransferState.RESERVED
        producer.store.put("late", t)
        assert consumer.wait(transfer) is TransferState.LANDED
        assert same_bits(tensors.from_bytes(consumer.staging.view(slot), fetch.shape, fetch.dtype), t)
    finally:
        consumer.close()


def test_compatibility_mismatch_fails_the_item_with_a_message_naming_the_difference(producer):
    consumer = Consumer(compat_info=compat(width=96))
    try:
        producer.store.put("x", torch.zeros(4, 128, dtype=torch.bfloat16))
        transfer, _ = consumer.get(producer.endpoint, "x", 4 * 128 * 2)
        assert transfer.state is TransferState.FAILED
        assert "incompatible" in transfer.error and "embed_width" in transfer.error
    finally:
        consumer.close()


def test_a_reservation_smaller_than_the_item_is_refused(producer):
    consumer = Consumer()
    try:
        producer.store.put("big", torch.zeros(64, 128, dtype=torch.bfloat16))
        transfer, _ = consumer.get(producer.endpoint, "big", 1024)
        assert transfer.state is TransferState.FAILED and "reserved" in transfer.error
    finally:
        consumer.close()


def test_an_item_never_encoded_times_out_at_the_producer():
    p = Producer(item_wait_s=0.3)
    consumer = Consumer()
    try:
        transfer, _ = consumer.get(p.endpoint, "never", 256)
        assert transfer.state is TransferState.FAILED and "not encoded" in transfer.error
    finally:
        consumer.close()
        p.close()


def test_a_producer_that_dies_mid_wait_fails_the_item_promptly():
    p = Producer(item_wait_s=30)
    consumer = Consumer(timeout_s=30)
    try:
        transfer, _, _ = consumer.start(p.endpoint, "orphan", 256)
        time.sleep(0.3)
        t0 = time.monotonic()
        p.close()
        assert consumer.wait(transfer, timeout=20) is TransferState.FAILED
        assert time.monotonic() - t0 < 20  # promptly: well before the consumer's own 30 s timeout
        assert "UNAVAILABLE" in transfer.error or "closed" in transfer.error or "CANCELLED" in transfer.error
    finally:
        consumer.close()


def test_an_unacked_item_is_freed_when_its_lease_expires():
    p = Producer(ttl_s=0.2)
    try:
        p.store.put("stale", torch.zeros(8, 8, dtype=torch.float32))
        steps_until(lambda: not p.store.contains("stale"))
        assert not p.store.contains("stale") and p.store.stats.expired == 1
    finally:
        p.close()


def _probe(endpoint: str, transports: str, isolated: bool) -> str:
    cmd = [sys.executable, "-m", "tests.integration.probe_peer", endpoint, transports]
    if isolated:  # a separate mount namespace with its own, empty /dev/shm
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_selection_same_host_chooses_shm(producer):
    assert _probe(producer.endpoint, "shm,grpc", isolated=False) == "CHOSE shm"


@pytest.mark.skipif(not _can_unshare(), reason="this sandbox forbids mount namespaces (unshare -m)")
def test_selection_without_the_producers_dev_shm_falls_back_to_chunks(producer):
    assert _probe(producer.endpoint, "shm,grpc", isolated=True) == "CHOSE grpc"


@pytest.mark.skipif(not _can_unshare(), reason="this sandbox forbids mount namespaces (unshare -m)")
def test_a_forced_transport_that_cannot_work_fails_the_handshake_clearly(producer):
    out = _probe(producer.endpoint, "shm", isolated=True)
    assert out.startswith("ERROR") and "forced" in out and "cannot map" in out, out


def test_a_reserve_for_a_settled_claim_fails_fast_and_a_new_claims_copy_is_served(producer):
    """Two LMs, one image, two Encodes: the first LM acks its claim (the encoder frees the copy);
    a Reserve naming that claim again is answered NOT_FOUND at once, not after the full wait.
    The second LM's claim is waited for until its encode publishes the copy."""
    first, second = Consumer(), Consumer()
    try:
        t = torch.randn(8, 128).to(torch.bfloat16)
        producer.store.put("twice", t, claims=("enc-1",))
        transfer, got = first.get(producer.endpoint, "twice", t.numel() * 2, claim="enc-1")
        assert transfer.state is TransferState.LANDED and same_bits(got, t)
        steps_until(lambda: not producer.store.contains("twice"))  # the ack travels asynchronously
        assert not producer.store.contains("twice") and producer.store.stats.acks == 1
        t0 = time.monotonic()
        transfer, _ = second.get(producer.endpoint, "twice", t.numel() * 2, claim="enc-1")
        assert transfer.state is TransferState.FAILED and "claim was settled" in transfer.error
        assert time.monotonic() - t0 < producer.servicer.item_wait_s  # answered, not left to the full wait

        late, fetch, slot = second.start(producer.endpoint, "twice", t.numel() * 2, claim="enc-2")
        time.sleep(0.1)  # the Reserve waits for enc-2's copy
        producer.store.put("twice", t, claims=("enc-2",))
        assert second.wait(late) is TransferState.LANDED
        assert same_bits(tensors.from_bytes(second.staging.view(slot), fetch.shape, fetch.dtype), t)
        steps_until(lambda: not producer.store.contains("twice"))
        assert not producer.store.contains("twice") and producer.store.stats.acks == 2
    finally:
        first.close()
        second.close()


def test_in_place_two_consumers_read_one_item_and_the_first_ack_does_not_free_it_under_the_second(producer):
    from ectransfer.protocol import ItemTransfer
    from ectransfer.shm import Mappings

    a, b = Consumer(transports=("shm",)), Consumer(transports=("shm",))
    maps = Mappings()
    t = torch.randn(64, 128).to(torch.bfloat16)
    nbytes = t.numel() * 2
    producer.store.put("x", t, claims=("enc-a", "enc-b"))  # two Encodes of one image share the copy
    try:
        fetches = []
        for c, claim in ((a, "enc-a"), (b, "enc-b")):
            transfer = ItemTransfer("x", nbytes)
            fetches.append(c.client.fetch(transfer, producer.endpoint, c.staging.view(c.staging.alloc(nbytes)), "r",
                                          in_place=True, claim=claim))
            assert c.wait(transfer) is TransferState.LANDED
        src = fetches[1].source
        assert src.WhichOneof("payload") == "shm" and src.shm.segment == producer.pool.name
        used_before = producer.pool.stats()["used_bytes"]
        a.client.ack(producer.endpoint, "x", "enc-a", fetches[0].copy)
        steps_until(lambda: producer.store.stats.acks == 0 and producer.store.held("x").claims == {"enc-b"})
        assert producer.store.held("x").claims == {"enc-b"}  # a's claim settled, b's holds the copy
        assert producer.pool.stats()["used_bytes"] == used_before
        raw = maps.get(src.shm.segment).buffer[src.shm.offset: src.shm.offset + nbytes]
        assert same_bits(tensors.from_bytes(raw.clone(), (64, 128), torch.bfloat16), t)  # b's bytes intact
        b.client.ack(producer.endpoint, "x", "enc-b", fetches[1].copy)
        steps_until(lambda: producer.pool.stats()["used_bytes"] != used_before)
        assert producer.pool.stats()["used_bytes"] == used_before - nbytes  # the last claim's ack freed it
        assert producer.store.stats.acks == 1 and not producer.store.contains("x")
    finally:
        maps.close()
        a.close()
        b.close()


def test_in_place_asked_of_the_chunk_transport_lands_in_the_destination(producer):
    from ectransfer.protocol import ItemTransfer

    c = Consumer(transports=("grpc",))
    t = torch.randn(8, 128).to(torch.bfloat16)
    producer.store.put("z", t)
    try:
        slot = c.staging.alloc(t.numel() * 2)
        transfer = ItemTransfer("z", t.numel() * 2)
        fetch = c.client.fetch(transfer, producer.endpoint, c.staging.view(slot), "r", in_place=True)
        assert c.wait(transfer) is TransferState.LANDED and fetch.source is None
        assert same_bits(tensors.from_bytes(c.staging.view(slot), fetch.shape, fetch.dtype), t)
    finally:
        c.close()


def test_in_place_a_header_the_consumer_refuses_releases_the_producers_hold(producer):
    from ectransfer.protocol import ItemTransfer

    c = Consumer(transports=("shm",))
    producer.store.put("short", torch.zeros(8, 8, dtype=torch.bfloat16))  # 128 bytes
    try:
        slot = c.staging.alloc(256)  # the consumer expected 256
        transfer = ItemTransfer("short", 256)
        c.client.fetch(transfer, producer.endpoint, c.staging.view(slot), "r", in_place=True)
        assert c.wait(transfer) is TransferState.FAILED and "expected 256" in transfer.error
        steps_until(lambda: not producer.store.contains("short"))
        assert not producer.store.contains("short") and producer.store.stats.cancels == 1
    finally:
        c.close()


def _peer(consumer, endpoint):
    import asyncio

    async def get():
        return consumer.client._peers.get(endpoint)

    return asyncio.run_coroutine_threadsafe(get(), consumer.client._loop).result(30)


def test_lane_items_of_an_in_place_transport_move_to_the_control_lane_and_stay_exact(producer):
    consumer = Consumer(transports=("shm",))
    try:
        t = torch.randn(32, 128).to(torch.bfloat16)
        producer.store.put("l1", t)
        transfer, got = consumer.get(producer.endpoint, "l1", t.numel() * 2)
        assert transfer.state is TransferState.LANDED and same_bits(got, t)
        peer = _peer(consumer, producer.endpoint)
        assert peer.writer is not None and peer.mode.result() == "lane"
        steps_until(lambda: not producer.store.contains("l1"))
        assert not producer.store.contains("l1") and producer.store.stats.acks == 1  # the Ack went on the lane
    finally:
        consumer.close()


def test_lane_not_offered_or_not_used_keeps_items_on_the_grpc_stream():
    from tests.support.loopback import Producer as P

    p = P(lane=False)
    consumers = [Consumer(transports=("shm",)), Consumer(transports=("grpc",))]
    try:
        for i, consumer in enumerate(consumers):
            t = torch.randn(8, 128).to(torch.bfloat16)
            p.store.put(f"g{i}", t)
            transfer, got = consumer.get(p.endpoint, f"g{i}", t.numel() * 2)
            assert transfer.state is TransferState.LANDED and same_bits(got, t)
            assert _peer(consumer, p.endpoint).mode.result() == "grpc"
    finally:
        for consumer in consumers:
            consumer.close()
        p.close()


def test_lane_a_connection_without_its_streams_secret_is_refused(producer):
    import socket

    from ectransfer import lane

    address = producer.servicer.lane_address
    assert address
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)  # the producer closes it at once; this only bounds a hang
        s.connect("\0" + address)
        try:
            s.sendall(lane.frame(transfer_pb2.TransferClientMsg(
                select=transfer_pb2.Select(transport=transfer_pb2.SHM, proof=b"guess"))))
            s.sendall(lane.frame(transfer_pb2.TransferClientMsg(
                reserve=transfer_pb2.Reserve(identifier="x", max_nbytes=8))))
            got = s.recv(64)
        except (ConnectionResetError, BrokenPipeError):  # closed with our frames unread
            got = b""
        assert got == b""  # closed, nothing served
