"""The encoder's host tier (issue 33): an output kept after its LM acked it serves the next encode of
the same item without a new slot or a vision run (the producer says ``has_cache_item``, and vLLM's room
for it is dropped once its request lets go); pool pressure evicts kept outputs before it defers
anything. Real pools, the real Transfer server thread, a real datagram socket and our encoder cache
manager; vLLM's request objects are stand-ins (``connector_fakes``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ectransfer.connector.cache_manager import EPDEncoderCacheManager, manager_for
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.producer import ProducerScheduler, ProducerWorker
from tests.integration.connector_fakes import embedding, request, steps_until, vllm_config

pytestmark = pytest.mark.integration

ITEM_BYTES = 16 * 128 * 2  # 16 rows of 128 bf16


@pytest.fixture
def halves(request):
    engine = f"enc-tier-{request.node.name}"
    EPDEncoderCacheManager.create_manager(cache_size=1000, vllm_config=vllm_config(engine))
    cfg = ConnectorConfig(outbound_pool_bytes=4 * ITEM_BYTES + 4096,  # + the shm transport's probe slot
                          host_tier_bytes=2 * ITEM_BYTES, model_name="m")
    ps = ProducerScheduler(vllm_config(engine), cfg).start()
    pw = ProducerWorker(vllm_config(engine), ConnectorConfig(model_name="m")).start()
    yield ps, pw, manager_for(engine)
    pw.shutdown()
    ps.shutdown()


def _encode(ps, pw, rid: str, ident: str, seed: int = 1) -> None:
    """One encode request of ``ident`` the way vLLM's scheduler runs it: reserve (or claim), ask whether
    the output is already had, run the vision (save) only if not, finish."""
    req = request(rid, [(ident, 16)])
    assert ps.ensure_cache_available(req, 0)
    manager = manager_for(ps.engine_id)
    assert manager.can_allocate(req, 0, 10_000, 0)
    external = ps.has_cache_item(ident)
    manager.allocate(req, 0)
    ps.update_state_after_alloc(req, 0)
    meta = ps.build_meta(SimpleNamespace(scheduled_encoder_inputs={} if external else {rid: [0]},
                                         total_num_scheduled_tokens=0))
    pw.begin_step({}, meta)
    if not external:
        pw.save({ident: embedding(16, seed)}, ident)
        assert steps_until(lambda: ps.store.contains(ident))
    ps.request_finished(req)
    manager.free(req)
    return external


def test_an_acked_output_is_kept_and_serves_the_next_encode_without_a_vision_run(halves):
    ps, pw, manager = halves
    assert not _encode(ps, pw, "e1", "a")
    ps.store.ack("a", "e1")  # the LM has its copy
    snap = ps.stats_snapshot()
    assert (snap["items_held"], snap["tier_items"], snap["tier_bytes"]) == (0, 1, ITEM_BYTES)
    assert _encode(ps, pw, "e2", "a")  # served from the tier: vLLM skips the vision run
    snap = ps.stats_snapshot()
    assert snap["tier_hits"] == 1 and snap["items_held"] == 1 and snap["pending_reservations"] == 0
    # vLLM's room for the output it never had is gone with its request: a later encode does not find it.
    assert not manager.is_cached("a") and not manager.is_external("a")
    ps.store.ack("a", "e2")
    assert ps.stats_snapshot()["tier_items"] == 1


def test_a_new_output_evicts_kept_ones_rather_than_waiting(halves):
    ps, pw, _ = halves
    for i, ident in enumerate("abcd"):
        _encode(ps, pw, f"e{i}", ident, seed=i)
        ps.store.ack(ident, f"e{i}")
    snap = ps.stats_snapshot()
    assert snap["tier_items"] == 2 and snap["tier_evictions"] == 2  # the tier's own bound: 2 items
    for i, ident in enumerate("wxyz"):  # four new outputs in flight fill the pool: the tier gives way
        req = request(f"n{i}", [(ident, 16)])
        assert ps.ensure_cache_available(req, 0), ident
    snap = ps.stats_snapshot()
    assert snap["tier_items"] == 0 and snap["pending_reservations"] == 4


def test_a_reservation_waits_while_vllm_still_counts_an_output_it_never_had(halves):
    """The store let the tier's copy go while the request it served still holds vLLM's room for it: a
    new encode of that item would be taken as cached (no vision run), so it waits for that request."""
    ps, pw, manager = halves
    _encode(ps, pw, "e1", "a")
    ps.store.ack("a", "e1")
    holder = request("e2", [("a", 16)])
    assert ps.ensure_cache_available(holder, 0) and ps.has_cache_item("a")
    manager.allocate(holder, 0)
    ps.update_state_after_alloc(holder, 0)
    ps.store.ack("a", "e2")
    ps.store.clear_tier()  # evicted meanwhile
    late = request("e3", [("a", 16)])
    assert not ps.ensure_cache_available(late, 0)
    ps.request_finished(holder)
    manager.free(holder)
    assert ps.ensure_cache_available(late, 0) and not ps.has_cache_item("a")  # reserved: the vision runs
