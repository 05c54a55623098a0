"""The NIXL transport's checks that need no agent: its registry row, and what a consumer refuses in
an offer or an item header before any NIXL call (a range outside the proven region above all)."""

from __future__ import annotations

import pytest

from ectransfer import factory
from ectransfer.nixl import MAX_METADATA_NBYTES, NixlConsumer
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2

REGION = 1 << 20


def _offer(**probe) -> transfer_pb2.TransportOffer:
    fields = dict(agent_metadata=b"m", agent="epd-producer-1-aa", region_address=1 << 30, region_nbytes=REGION,
                  mem_type="DRAM", probe_offset=0, probe_nbytes=16)
    fields.update(probe)
    return transfer_pb2.TransportOffer(transport=transfer_pb2.NIXL, nixl_probe=transfer_pb2.NixlProbe(**fields))


def _item(offset: int, nbytes: int, **ref) -> transfer_pb2.TensorDescriptor:
    fields = dict(agent="epd-producer-1-aa", offset=offset, region_nbytes=REGION, notif=b"t")
    fields.update(ref)
    return transfer_pb2.TensorDescriptor(shape=[nbytes], dtype=transfer_pb2.UINT8, nbytes=nbytes,
                                         nixl=transfer_pb2.NixlRef(**fields))


def test_nixl_is_registered_by_name_and_enum_but_never_chosen_by_auto():
    assert "nixl" in factory.NAMES
    assert factory.transport_enum("nixl") == transfer_pb2.NIXL
    assert factory.transport_name(transfer_pb2.NIXL) == "nixl"
    for role in ("producer", "consumer"):
        assert "nixl" not in factory.resolve(["auto"], role)
        assert factory.resolve(["nixl"], role) == ["nixl"]


def test_the_lm_service_checks_nixl_provisionally_without_an_agent():
    service = factory.make_service_consumer("nixl")
    assert service.provisional
    assert service.probe(_offer()) == b""
    with pytest.raises(ProtocolError, match="without its probe"):
        service.probe(transfer_pb2.TransportOffer(transport=transfer_pb2.NIXL))


@pytest.mark.parametrize("offset,nbytes", [(REGION, 1), (REGION - 8, 16), (2**63, 16), (0, REGION + 1)])
def test_an_item_outside_the_proven_region_is_refused(offset, nbytes):
    with pytest.raises(ProtocolError, match="region|range|outside|exceeds"):
        NixlConsumer().check_source(_item(offset, nbytes), _offer())


def test_an_item_inside_the_proven_region_passes_the_check():
    NixlConsumer().check_source(_item(REGION - 16, 16), _offer())


@pytest.mark.parametrize("ref,match", [({"agent": "epd-producer-2-bb"}, "proved"),
                                       ({"region_nbytes": 2 * REGION}, "proved"),
                                       ({"notif": b"x" * 65}, "notification")])
def test_an_item_of_another_agent_region_or_with_a_long_notification_is_refused(ref, match):
    with pytest.raises(ProtocolError, match=match):
        NixlConsumer().check_source(_item(0, 16, **ref), _offer())


def test_an_item_on_a_stream_that_proved_no_nixl_agent_is_refused():
    with pytest.raises(ProtocolError, match="proved no NIXL agent"):
        NixlConsumer().check_source(_item(0, 16), transfer_pb2.TransportOffer(transport=transfer_pb2.NIXL))
    with pytest.raises(ProtocolError, match="chose nixl"):
        NixlConsumer().check_source(transfer_pb2.TensorDescriptor(nbytes=1, shm=transfer_pb2.ShmRef()), _offer())


@pytest.mark.parametrize("offer,match", [
    (transfer_pb2.TransportOffer(transport=transfer_pb2.NIXL), "without its probe"),
    (_offer(agent_metadata=b""), "metadata"),
    (_offer(agent_metadata=b"x" * (MAX_METADATA_NBYTES + 1)), "metadata"),
])
def test_a_malformed_offer_is_refused_before_any_agent_is_made(offer, match):
    consumer = NixlConsumer()
    with pytest.raises(ProtocolError, match=match):
        consumer.probe(offer)
    assert consumer._agent is None


def test_a_progress_thread_its_owner_never_stopped_is_stopped_at_exit_before_the_interpreter_finalizes():
    # A daemon thread inside a NIXL call when the interpreter finalizes is ended by pthread_exit through the
    # binding's noexcept C++ frames, which aborts the process; the atexit hook stops every one first.
    from types import SimpleNamespace

    from ectransfer import nixl_agent

    calls = []
    agent = SimpleNamespace(nixl=SimpleNamespace(get_new_notifs=lambda: calls.append(1) or {}))
    progress = nixl_agent.Progress(agent)
    progress.start()
    while not calls:
        pass
    assert progress in nixl_agent._running
    nixl_agent._kept_at_exit()
    assert not progress._thread.is_alive() and progress not in nixl_agent._running
