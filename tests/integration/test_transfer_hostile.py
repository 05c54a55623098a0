"""What a broken or hostile Transfer peer can make the producer hold: bounded
sessions, Reserves, records, queued bytes and in-place holds; a control lane
opened only by its stream's single-use secret; a vanished peer noticed."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from ectransfer.limits import TransferLimits
from ectransfer.protocol import TransferState
from epd.transfer.v1 import transfer_pb2
from tests.integration.connector_fakes import steps_until
from tests.integration.hostile_peer import RawStream, lane_select
from tests.support.loopback import Consumer, Producer

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _until(predicate, timeout: float = 30.0) -> None:
    """Polls ``predicate`` on the test's loop until it holds (the producer's own thread moves on
    meanwhile); fails after ``timeout``, which only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s"
        await asyncio.sleep(0.01)


def _sessions(producer: Producer):
    """The producer's sessions past their handshake (read from the test thread)."""
    while True:
        try:
            return list(producer.servicer.sessions)
        except RuntimeError:  # the set changed size under us: the server thread moved on
            continue


def test_a_flood_of_reserves_gets_resource_exhausted_beyond_the_limit_and_a_good_peer_is_still_served():
    producer = Producer(item_wait_s=30, limits=TransferLimits(max_reserves_per_session=8))
    good = Consumer(transports=("grpc",))

    async def flood() -> list[transfer_pb2.ItemError]:
        stream = await RawStream.open(producer.endpoint)
        try:
            for i in range(200):  # never encoded: each would wait item_wait_s in a task of its own
                await stream.reserve(f"never-{i}")
            errors = []
            while len(errors) < 192:
                errors.append((await stream.read()).error)
            assert max(s.outstanding for s in _sessions(producer)) <= 8
            return errors
        finally:
            await stream.close()

    try:
        errors = asyncio.run(flood())
        assert {e.code for e in errors} == {transfer_pb2.ItemError.RESOURCE_EXHAUSTED}
        assert {e.identifier for e in errors} == {f"never-{i}" for i in range(8, 200)}
        t = torch.randn(8, 128).to(torch.bfloat16)
        producer.store.put("fine", t)
        transfer, got = good.get(producer.endpoint, "fine", t.numel() * 2)
        assert transfer.state is TransferState.LANDED and torch.equal(got, t)
    finally:
        good.close()
        producer.close()


def test_a_flood_of_cancels_for_random_claims_keeps_the_records_bounded():
    producer = Producer(max_settled_claims=100)
    rng = random.Random(3)

    async def flood() -> None:
        stream = await RawStream.open(producer.endpoint)
        try:
            for _ in range(3000):
                await stream.cancel(f"{rng.getrandbits(64):016x}", claim=f"{rng.getrandbits(64):016x}")
            for _ in range(3000):  # one identifier, over and over, one claim
                await stream.cancel("same", claim="one")
            producer.store.put("after", torch.zeros(4, 128, dtype=torch.bfloat16), claims=("mine",))
            await stream.reserve("after", claim="mine")  # answered only once every Cancel before it was handled
            assert (await stream.read()).WhichOneof("msg") == "header"
        finally:
            await stream.close()

    try:
        asyncio.run(flood())
        assert producer.store.settled_records() == 100  # the newest 100 (claim, identifier) pairs
        assert producer.store.settled("same", "one")  # the newest ones are kept
    finally:
        producer.close()


def test_sessions_beyond_max_sessions_are_refused_with_resource_exhausted_until_one_ends():
    producer = Producer(limits=TransferLimits(max_sessions=2))

    async def run() -> None:
        first = await RawStream.open(producer.endpoint)
        second = await RawStream.open(producer.endpoint)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await RawStream.open(producer.endpoint)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await first.close()
        await _until(lambda: producer.servicer.open_sessions < 2)
        third = await RawStream.open(producer.endpoint)  # a slot is free again
        assert third.selected.transport == transfer_pb2.GRPC_CHUNKS
        await third.close()
        await second.close()

    try:
        asyncio.run(run())
    finally:
        producer.close()


def test_a_lane_connection_beyond_max_sessions_is_closed_even_with_a_valid_secret():
    producer = Producer(limits=TransferLimits(max_sessions=1))

    async def run():
        stream = await RawStream.open(producer.endpoint, "shm")
        try:
            assert stream.selected.lane_secret
            reply, writer = await lane_select(producer.servicer.lane_address, transfer_pb2.SHM,
                                              stream.selected.lane_secret)
            writer.close()
            return reply
        finally:
            await stream.close()

    try:
        assert asyncio.run(run()) is None
        assert producer.servicer.refused_sessions == 1
    finally:
        producer.close()


def test_lane_the_reusable_probe_nonce_does_not_open_a_lane(producer_with_lane):
    producer = producer_with_lane

    async def run():
        stream = await RawStream.open(producer.endpoint, "shm")
        try:
            assert stream.proof  # the nonce the gRPC stream accepted
            reply, writer = await lane_select(producer.servicer.lane_address, transfer_pb2.SHM, stream.proof)
            writer.close()
            return reply
        finally:
            await stream.close()

    assert asyncio.run(run()) is None


def test_lane_a_secret_opens_one_connection_of_its_own_stream_and_none_after_it_ends(producer_with_lane):
    producer = producer_with_lane
    address = producer.servicer.lane_address

    async def run() -> None:
        a = await RawStream.open(producer.endpoint, "shm")
        b = await RawStream.open(producer.endpoint, "shm")
        secret_a, secret_b = a.selected.lane_secret, b.selected.lane_secret
        assert len(secret_a) == 32 and secret_a != secret_b
        reply, lane_a = await lane_select(address, transfer_pb2.SHM, secret_a)
        assert reply is not None and reply.WhichOneof("msg") == "selected"  # the secret works, once
        again, writer = await lane_select(address, transfer_pb2.SHM, secret_a)
        writer.close()
        assert again is None  # single use
        await b.close()  # b's stream ended before its secret was used
        await _until(lambda: producer.servicer.open_sessions <= 2)  # a's stream and a's lane
        late, writer = await lane_select(address, transfer_pb2.SHM, secret_b)
        writer.close()
        assert late is None  # forgotten with its stream
        lane_a.close()
        await a.close()

    asyncio.run(run())


@pytest.fixture
def producer_with_lane():
    p = Producer()
    assert p.servicer.lane_address
    yield p
    p.close()


def test_an_in_place_hold_that_is_never_acked_expires_and_frees_its_slot():
    producer = Producer(ttl_s=0.3, limits=TransferLimits(max_in_place_hold_s=0.3))
    baseline = producer.pool.stats()["used_bytes"]  # the shm transport's nonce slot

    async def run() -> None:
        stream = await RawStream.open(producer.endpoint, "shm")
        try:
            producer.store.put("held", torch.zeros(64, 128, dtype=torch.bfloat16))
            await stream.reserve("held")
            header = await stream.read()
            assert header.header.tensor.WhichOneof("payload") == "shm"
            # The stream stays open and never acks: a stopped LM.
            for _ in range(1000):
                if not producer.store.contains("held") and producer.pool.stats()["used_bytes"] == baseline:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the in-place hold never ended")
        finally:
            await stream.close()

    try:
        asyncio.run(run())
        assert producer.store.stats.expired == 1
    finally:
        producer.close()


def test_a_stream_that_never_reads_queues_at_most_its_byte_budget_then_gives_the_item_up():
    budget = 1 << 20
    producer = Producer(transports=("grpc",), chunk_nbytes=256 << 10, ttl_s=0.5,
                        limits=TransferLimits(max_stream_queued_bytes=budget, send_stall_s=1.0))

    async def run() -> int:
        stream = await RawStream.open(producer.endpoint)
        try:
            producer.store.put("big", torch.zeros(16 << 20, dtype=torch.uint8))
            await stream.reserve("big")  # and never read
            most = 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for s in _sessions(producer):
                    most = max(most, s.out.queued_bytes)
                if not producer.store.contains("big"):  # given up, then its lease expired
                    return most
                await asyncio.sleep(0.05)
            raise AssertionError("a stream that never reads kept its item")
        finally:
            await stream.close()

    try:
        most = asyncio.run(run())
        assert 0 < most <= budget
    finally:
        producer.close()


def test_a_peer_that_stops_answering_is_dropped_by_keepalive():
    producer = Producer(limits=TransferLimits(keepalive_s=0.5, keepalive_timeout_s=0.5))
    peer = subprocess.Popen([sys.executable, "-m", "tests.integration.hostile_peer", producer.endpoint],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "READY"
        assert steps_until(lambda: producer.servicer.open_sessions == 1)
        os.kill(peer.pid, signal.SIGSTOP)  # its TCP connection stays open; its HTTP/2 pings go unanswered
        assert steps_until(lambda: producer.servicer.open_sessions == 0, 30)
    finally:
        peer.kill()
        peer.wait()
        producer.close()


def test_oversized_claims_and_identifiers_are_dropped_not_remembered():
    producer = Producer()

    async def run() -> None:
        stream = await RawStream.open(producer.endpoint)
        try:
            for _ in range(100):
                await stream.cancel("x" * 10_000, claim="c")
                await stream.cancel("x", claim="c" * 10_000)
            await stream.reserve("y", claim="c" * 10_000)
            reply = await stream.read()
            assert reply.WhichOneof("msg") == "error" and "too long" in reply.error.message
        finally:
            await stream.close()

    try:
        asyncio.run(run())
        assert producer.store.settled_records() == 0
    finally:
        producer.close()
