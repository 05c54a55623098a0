"""The producer connector frees encoder outputs of aborted encode requests that
no consumer asked for, and its worker-report socket drops datagrams without
the engine's key. Real pools, the real Transfer server thread and a real
datagram socket; vLLM's request objects are stand-ins (``connector_fakes``)."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.producer import ProducerScheduler, ProducerWorker
from tests.integration.connector_fakes import embedding, request, steps_until, vllm_config

pytestmark = pytest.mark.integration


@pytest.fixture
def halves():
    ps = ProducerScheduler(vllm_config("enc-1"), ConnectorConfig(outbound_pool_bytes=1 << 20, model_name="m")).start()
    pw = ProducerWorker(vllm_config("enc-1"), ConnectorConfig(model_name="m")).start()
    yield ps, pw
    pw.shutdown()
    ps.shutdown()


def _dispatch(ps: ProducerScheduler, pw: ProducerWorker, req) -> dict:
    """Reserves ``req``'s items and hands the slots to the worker (one engine step)."""
    assert ps.ensure_cache_available(req, 0)
    meta = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={req.request_id: [0]}, total_num_scheduled_tokens=0))
    pw.begin_step({}, meta)  # nothing cached yet: each item is saved when the test says so
    return {f.identifier: embedding(f.mm_position.get_num_embeds(), 1) for f in req.mm_features}


def _ended(req, status: str):
    from vllm.v1.request import RequestStatus

    req.status = getattr(RequestStatus, status)
    return req


def test_an_aborted_request_whose_report_comes_later_frees_its_item_on_arrival(halves):
    ps, pw = halves
    req = request("e1", [("a", 16)])
    outputs = _dispatch(ps, pw, req)
    ps.request_finished(_ended(req, "FINISHED_ABORTED"))  # the service aborted it mid-encode
    assert ps.stats_snapshot()["pending_reservations"] == 1  # the worker is still writing the slot
    pw.save(outputs, "a")
    assert steps_until(lambda: ps.stats_snapshot()["pending_reservations"] == 0)
    assert not ps.store.contains("a")
    snap = ps.stats_snapshot()
    assert snap["items_held"] == 0 and snap["cancels"] == 1


def test_an_aborted_request_whose_item_is_already_stored_frees_it_when_it_ends(halves):
    ps, pw = halves
    req = request("e1", [("a", 16)])
    pw.save(_dispatch(ps, pw, req), "a")
    assert steps_until(lambda: ps.store.contains("a"))
    ps.request_finished(_ended(req, "FINISHED_ABORTED"))
    assert not ps.store.contains("a") and ps.stats_snapshot()["items_held"] == 0


def test_a_request_that_ends_normally_keeps_its_item_for_the_consumer(halves):
    ps, pw = halves
    req = request("e1", [("a", 16)])
    pw.save(_dispatch(ps, pw, req), "a")
    assert steps_until(lambda: ps.store.contains("a"))
    ps.request_finished(_ended(req, "FINISHED_STOPPED"))
    assert ps.store.contains("a")
    # A later request for the same image that is aborted does not take it from the first one's consumer.
    again = request("e2", [("a", 16)])
    assert ps.ensure_cache_available(again, 0)
    ps.request_finished(_ended(again, "FINISHED_ABORTED"))
    assert ps.store.contains("a")


def test_an_item_a_consumer_already_asked_for_is_kept_after_the_abort(halves):
    ps, pw = halves
    req = request("e1", [("a", 16)])
    outputs = _dispatch(ps, pw, req)
    asked = []
    ps.store.on_ready("a", "lm-claim", asked.append)  # an LM's Reserve, waiting for the encode
    ps.request_finished(_ended(req, "FINISHED_ABORTED"))
    pw.save(outputs, "a")
    assert steps_until(lambda: asked)
    assert asked[0] is not None and ps.store.contains("a")
    ps.request_finished(_ended(request("e9", [("a", 16)]), "FINISHED_ABORTED"))
    assert ps.store.contains("a")  # asked for: only the consumer's Ack or the lease frees it
    ps.store.ack("a", "lm-claim")
    assert not ps.store.contains("a")


def test_an_item_another_live_request_shares_is_kept_after_one_abort(halves):
    ps, pw = halves
    first, second = request("e1", [("a", 16)]), request("e2", [("a", 16)])
    outputs = _dispatch(ps, pw, first)
    assert ps.ensure_cache_available(second, 0)  # same image, still being encoded
    ps.request_finished(_ended(first, "FINISHED_ABORTED"))
    pw.save(outputs, "a")
    assert steps_until(lambda: ps.store.contains("a"))
    assert ps.store.held("a").claims == {"e2"}  # the aborted request's claim went; the live one's holds it


def test_the_report_socket_drops_datagrams_without_the_engines_key(halves):
    ps, pw = halves
    req = request("e1", [("a", 16)])
    outputs = _dispatch(ps, pw, req)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps({"id": "a"}).encode(), ps.notify_addr)  # a forged "saved" report
        s.sendto(b"\0" * 16 + json.dumps({"id": "a", "error": "forged"}).encode(), ps.notify_addr)
    assert not steps_until(lambda: ps.store.contains("a"), timeout=0.5)  # the unwritten slot is not published
    assert ps.stats_snapshot()["pending_reservations"] == 1
    pw.save(outputs, "a")  # the real worker's report, which carries the key
    assert steps_until(lambda: ps.store.contains("a"))
    assert ps.stats_snapshot()["failed"] == 0  # the forged failure was never read
    assert ps._refused_reports == 2


def test_a_slot_handed_to_the_worker_for_an_aborted_request_that_never_encoded_it_is_freed(halves):
    """vLLM hands every new reservation to the worker at the next step, before the item is encoded
    (its encoder input may be scheduled steps later). If the request is aborted first, the worker
    never saves it: the scheduler tells the worker to drop the slot and frees it on the report."""
    ps, pw = halves
    req = request("e1", [("a", 16), ("b", 16)])
    outputs = _dispatch(ps, pw, req)  # both slots with the worker; only "a" gets encoded
    pw.save(outputs, "a")
    assert steps_until(lambda: ps.store.contains("a"))
    ps.request_finished(_ended(req, "FINISHED_ABORTED"))
    assert ps.stats_snapshot()["pending_reservations"] == 1  # "b": the worker still has its slot
    meta = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0))
    assert meta.drops == ["b"]
    pw.begin_step({}, meta)
    assert steps_until(lambda: ps.stats_snapshot()["pending_reservations"] == 0)
    snap = ps.stats_snapshot()
    assert snap["items_held"] == 0 and snap["reserved_bytes"] == 0 and snap["pool_used_bytes"] <= 256  # the probe slot
    pw.save({"b": embedding(16, 2)}, "b")  # a late save of a dropped slot writes nothing, reports nothing
    assert not steps_until(lambda: ps.store.contains("b"), timeout=0.3)


def test_a_dropped_slot_another_request_asked_for_meanwhile_is_handed_over_again(halves):
    ps, pw = halves
    first = request("e1", [("a", 16)])
    _dispatch(ps, pw, first)
    ps.request_finished(_ended(first, "FINISHED_ABORTED"))
    drop = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0))
    assert drop.drops == ["a"]
    second = request("e2", [("a", 16)])
    assert ps.ensure_cache_available(second, 0)  # joins the reservation the drop is about
    pw.begin_step({}, drop)  # the worker drops it and reports
    again = None
    deadline = time.monotonic() + 30  # the worker's report crosses a datagram socket and a thread
    while time.monotonic() < deadline:
        again = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=0))
        if again.saves:
            break
        time.sleep(0.01)
    assert [s.identifier for s in again.saves] == ["a"]  # handed over again, for e2
    pw.begin_step({}, again)
    pw.save({"a": embedding(16, 1)}, "a")
    assert steps_until(lambda: ps.store.contains("a"))
    assert ps.store.held("a").claims == {"e2"}
