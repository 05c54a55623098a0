"""The NIXL transport with real agents: items pulled by one-sided READs on the Transfer stream's
Reserve/Ack, exact; what a hostile or broken peer gets (a range outside the proven region, a
different compatibility, an offer that does not work, a producer killed mid-READ, staging freed
while a READ is in flight): a clear error or a fallback, and nothing held on either side."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from ectransfer.nixl import NixlConsumer, NixlProducer
from ectransfer.protocol import TransferState
from epd.transfer.v1 import transfer_pb2
from tests.integration.nixl_peers import Peer
from tests.integration.rogue_producer import RogueProducer
from tests.support.loopback import Consumer, Producer, compat

pytestmark = pytest.mark.integration

TCP = {"UCX_TLS": "tcp"}  # a READ over TCP needs the producer's progress: it can be caught in flight


def _nixl(consumer: Consumer) -> NixlConsumer:
    return next(t for t in consumer.client.transports if isinstance(t, NixlConsumer))


def _until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def _holds(producer) -> int:
    while True:
        try:
            return sum(len(s.holds) for s in list(producer.servicer.sessions))
        except RuntimeError:  # the set changed under us
            continue


def test_items_land_exact_over_nixl_and_the_stream_end_removes_the_remote_agent():
    producer = Producer(transports=("nixl",))
    consumer = Consumer(transports=("nixl",))
    nixl = _nixl(consumer)
    try:
        for i, rows in enumerate((1, 300, 4096)):
            t = torch.randn(rows, 128).to(torch.bfloat16)
            producer.store.put(f"item-{i}", t)
            transfer, got = consumer.get(producer.endpoint, f"item-{i}", t.numel() * 2)
            assert transfer.state is TransferState.LANDED, transfer.error
            assert torch.equal(got.view(torch.int16), t.view(torch.int16))
        assert consumer.client.transport_of(producer.endpoint) == "nixl"
        assert nixl.reads == 3 and len(nixl.remote_agents) == 1
        _until(lambda: producer.store.snapshot()["items"] == 0, "the acked copies freed")
        server_side = producer.servicer.transports[transfer_pb2.NIXL]
        assert isinstance(server_side, NixlProducer)
        _until(lambda: server_side.progress.outstanding == 0, "every READ's notification back")
    finally:
        consumer.close()
        producer.close()
    assert nixl.remote_agents == []  # released when the stream ended
    nixl.close()
    assert nixl.registered_regions == 0


@pytest.mark.parametrize("lie", ["past the end", "another agent", "another region size"])
def test_a_descriptor_outside_the_proven_region_is_refused_before_any_read_is_posted(lie):
    def header(desc: transfer_pb2.TensorDescriptor) -> None:
        if lie == "past the end":
            desc.nixl.offset = desc.nixl.region_nbytes - desc.nbytes // 2
        elif lie == "another agent":
            desc.nixl.agent = "epd-producer-1-000000000000"
        else:
            desc.nixl.region_nbytes *= 2

    producer = RogueProducer(header=header, transports=("nixl",))
    consumer = Consumer(transports=("nixl",))
    nixl = _nixl(consumer)
    try:
        t = torch.randn(64, 128).to(torch.bfloat16)
        producer.store.put("x", t)
        transfer, got = consumer.get(producer.endpoint, "x", t.numel() * 2)
        assert transfer.state is TransferState.FAILED and got is None
        assert "NIXL" in transfer.error or "region" in transfer.error, transfer.error
        assert nixl.reads == 0  # the probe's READ only: no item READ was posted
        _until(lambda: _holds(producer._real) == 0, "the producer's hold released by the consumer's Cancel")
    finally:
        consumer.close()
        producer.close()
    assert nixl.remote_agents == []
    nixl.close()


def test_a_producer_whose_compatibility_differs_is_refused_and_no_agent_is_loaded():
    producer = Producer(transports=("nixl",), compat_info=compat(width=256))
    consumer = Consumer(transports=("nixl",))
    nixl = _nixl(consumer)
    try:
        producer.store.put("x", torch.zeros(4, 256, dtype=torch.bfloat16))
        transfer, got = consumer.get(producer.endpoint, "x", 4 * 256 * 2)
        assert transfer.state is TransferState.FAILED and got is None
        assert "compat" in transfer.error.lower() or "width" in transfer.error.lower(), transfer.error
        assert nixl.remote_agents == []
    finally:
        consumer.close()
        producer.close()
    nixl.close()


def test_an_offer_that_does_not_work_falls_back_to_grpc_visibly_and_forced_nixl_fails_with_the_reason(caplog):
    def offer(o: transfer_pb2.TransportOffer) -> None:
        if o.transport == transfer_pb2.NIXL:
            o.nixl_probe.agent_metadata = b"not an agent's metadata"

    producer = RogueProducer(offer=offer, transports=("nixl", "grpc"))
    either = Consumer(transports=("nixl", "grpc"))
    forced = Consumer(transports=("nixl",))
    try:
        t = torch.randn(16, 128).to(torch.bfloat16)
        producer.store.put("x", t)
        with caplog.at_level(logging.WARNING, logger="ectransfer.peer_session"):
            transfer, got = either.get(producer.endpoint, "x", t.numel() * 2)
        assert transfer.state is TransferState.LANDED and torch.equal(got.view(torch.int16), t.view(torch.int16))
        assert either.client.transport_of(producer.endpoint) == "grpc"
        assert any("uses grpc" in r.getMessage() and "nixl:" in r.getMessage() for r in caplog.records)
        producer.store.put("y", t)
        transfer, got = forced.get(producer.endpoint, "y", t.numel() * 2)
        assert transfer.state is TransferState.FAILED and "no usable transport (forced)" in transfer.error
        assert "NIXL agent" in transfer.error, transfer.error
        assert _nixl(either).remote_agents == [] and _nixl(forced).remote_agents == []
    finally:
        either.close()
        forced.close()
        producer.close()


@pytest.fixture(scope="module")
def consumer_peer():
    """One consumer process with UCX held to TCP, shared by the fault tests (each uses its own
    producers and item names; what it holds is checked after each)."""
    peer = Peer("consumer", env=TCP)
    yield peer
    peer.close()


@pytest.fixture
def producers():
    """Producer processes with UCX held to TCP; each is closed (or killed) at the end."""
    made: list[Peer] = []

    def make() -> Peer:
        made.append(Peer("producer", env=TCP))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def _landed_then_frozen(consumer: Peer, producer: Peer, ident: str) -> str:
    """One small item ``ident`` landed from ``producer`` (the stream and the remote agent are up), then the
    producer frozen: no progress on it, so the next READ over TCP stays in flight. Returns its endpoint."""
    endpoint = producer.hello["endpoint"]
    assert producer.ask("put", ident, 4096, 1)["ok"]
    consumer.ask("fetch", endpoint, ident, 4096)
    assert consumer.ask("wait", ident)["state"] == "LANDED"
    producer.ask("freeze")
    return endpoint


def _in_flight(consumer: Peer, ident: str) -> None:
    """The consumer's READ of ``ident`` is posted (its header checked, the item RECEIVING)."""
    _until(lambda: consumer.ask("state", ident)["state"] == "RECEIVING", f"{ident} in flight")


def test_a_producer_killed_mid_read_fails_the_item_and_the_consumer_goes_on_with_nothing_left(
        consumer_peer, producers):
    consumer = consumer_peer
    first = producers()
    endpoint = _landed_then_frozen(consumer, first, "small")
    assert first.ask("put", "big", 1 << 20, 2)["ok"]
    consumer.ask("fetch", endpoint, "big", 1 << 20)
    _in_flight(consumer, "big")
    first.kill()
    done = consumer.ask("wait", "big")
    assert done["state"] == "FAILED", done
    assert done["error"], done
    stats = consumer.ask("stats")
    assert stats["remote_agents"] == 0, stats  # the stream's end removed the dead producer's agent

    second = producers()
    assert second.ask("put", "again", 1 << 20, 3)["ok"]
    consumer.ask("fetch", second.hello["endpoint"], "again", 1 << 20)
    done = consumer.ask("wait", "again")
    assert done["state"] == "LANDED" and done["transport"] == "nixl", done
    assert consumer.ask("check", "again", 3)["exact"]


def test_staging_freed_while_its_read_is_in_flight_is_never_reused_under_it_and_the_hold_is_released(
        consumer_peer, producers):
    consumer = consumer_peer
    producer = producers()
    endpoint = _landed_then_frozen(consumer, producer, "warm")
    assert producer.ask("put", "early", 1 << 20, 2)["ok"]
    assert producer.ask("put", "next", 1 << 20, 3)["ok"]
    consumer.ask("fetch", endpoint, "early", 1 << 20)
    _in_flight(consumer, "early")
    consumer.ask("free", "early")  # the request went away: its staging is freed while the READ runs
    consumer.ask("fetch", endpoint, "next", 1 << 20)  # the freed staging, allocated again
    producer.ask("thaw")
    done = consumer.ask("wait", "next")
    assert done["state"] == "LANDED", done
    assert consumer.ask("check", "next", 3)["exact"]  # the early READ finished before "next" landed
    _until(lambda: producer.ask("stats")["holds"] == 0, "the producer's holds released")
    _until(lambda: producer.ask("stats")["items"] == 0, "the producer's copies freed")
    stats = consumer.ask("stats")
    assert stats["remote_agents"] == 1 and stats["regions"] <= 2, stats
