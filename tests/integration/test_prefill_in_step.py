"""Prefill in step with arrival, on the connector's scheduler half and our encoder cache manager (real gRPC,
real shared memory, no engine; the e2e half is tests/e2e/test_prefill_in_step.py): a request is let
compute up to its first item in flight, and no further (the manager's ``can_allocate`` is vLLM's stop
rule); the two-stage allocation still holds per item; a late item's cancel or failure releases everything.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ectransfer.connector import cache_manager
from ectransfer.connector.cache_manager import EPDEncoderCacheManager
from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
from tests.integration.connector_fakes import claim_of, embedding, request, steps_until, vllm_config

pytestmark = pytest.mark.integration

ENGINE = "lm-in-step"
BUDGET = 1 << 12


@pytest.fixture
def half():
    """A consumer scheduler half with our cache manager beside it, as in an LM engine."""
    made = []

    def make(**kw):
        manager = EPDEncoderCacheManager.create_manager(cache_size=BUDGET, vllm_config=vllm_config(ENGINE))
        cfg = ConnectorConfig(staging_bytes=1 << 20, transfer_timeout_s=10.0, model_name="test-model", **kw)
        made.append(ConsumerScheduler(vllm_config(ENGINE), cfg).start())
        return made[-1], manager

    yield make
    for sched in made:
        sched.shutdown()
    cache_manager._MANAGERS.pop(ENGINE, None)


def step(sched, manager, req, computed: int, tokens: int) -> None:
    """The step vLLM runs once ``ensure_cache_available`` said yes: it allocates the landed items whose
    placeholders fall in the ``tokens`` it computes from ``computed``, loads them, computes; the worker's
    report settles the loads."""
    for i, feat in enumerate(req.mm_features):
        if computed <= feat.mm_position.offset < computed + tokens and sched.has_cache_item(feat.identifier):
            manager.allocate(req, i)
            sched.update_state_after_alloc(req, i)
    meta = sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={}, total_num_scheduled_tokens=tokens,
                                            num_scheduled_tokens={req.request_id: tokens}))
    worker = ConsumerWorker(vllm_config(ENGINE), sched.cfg)
    worker.load({}, meta)
    sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=worker.build_worker_meta()))
    worker.shutdown()


def can_allocate(manager, req, index: int) -> bool:
    return manager.can_allocate(req, index, BUDGET, 0)


def test_the_prompt_is_computed_up_to_the_first_item_in_flight_and_on_as_items_land(producer, half):
    sched, manager = half()
    req = request("r1", [("a", 16), ("b", 16), ("c", 16)], producer.endpoint)  # at tokens 5, 24 and 43
    a, b, c = (f.mm_position.offset for f in req.mm_features)
    # Nothing landed: the 5 tokens before the first item can be computed, and vLLM stops at it.
    assert sched.ensure_cache_available(req, 0)
    assert not can_allocate(manager, req, 0)
    assert manager.preallocated.keys() == {"a", "b", "c"}  # stage 1 for every item, as before
    step(sched, manager, req, 0, a)
    assert sched.stats_snapshot()["prefill_ahead_tokens"] == a

    assert not sched.ensure_cache_available(req, a)  # the next token is the first item's: wait for it
    producer.store.put("a", embedding(16, 1), claims=(claim_of("r1"),))
    producer.store.put("c", embedding(16, 3), claims=(claim_of("r1"),))  # the third lands before the second
    assert steps_until(lambda: not sched.in_flight("a") and not sched.in_flight("c"))
    assert sched.ensure_cache_available(req, a)
    assert can_allocate(manager, req, 0) and not can_allocate(manager, req, 1)
    step(sched, manager, req, a, b - a)  # the first item loaded, its tokens and the text after it computed
    assert "a" not in manager.preallocated  # stage 2: the reservation became vLLM's allocation
    assert sched.stats_snapshot()["prefill_ahead_tokens"] == b

    assert not sched.ensure_cache_available(req, b)  # the second is late: the request waits at it
    producer.store.put("b", embedding(16, 2), claims=(claim_of("r1"),))
    assert steps_until(lambda: sched.ensure_cache_available(req, b))
    assert can_allocate(manager, req, 1) and can_allocate(manager, req, 2)
    step(sched, manager, req, b, 60 - b)  # the rest of the prompt
    assert sched.stats_snapshot()["prefill_ahead_tokens"] == b  # nothing was in flight in that step
    assert steps_until(lambda: not sched._items)
    sched.request_finished(req)
    assert sched.staging.stats()["used_bytes"] == 0 and not manager.preallocated
    assert steps_until(lambda: producer.store.stats.acks == 3)  # each copy acked once it was loaded


def test_waiting_for_every_item_when_prefill_in_step_is_off(producer, half):
    sched, manager = half(prefill_in_step=False)
    req = request("r1", [("a", 16), ("b", 16)], producer.endpoint)
    assert not sched.ensure_cache_available(req, 0)
    producer.store.put("a", embedding(16, 1), claims=(claim_of("r1"),))
    assert steps_until(lambda: not sched.in_flight("a"))
    assert not sched.ensure_cache_available(req, 0)  # "a" landed, "b" did not: the whole request waits
    producer.store.put("b", embedding(16, 2), claims=(claim_of("r1"),))
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    sched.request_finished(req)
    assert sched.stats_snapshot()["prefill_ahead_tokens"] == 0


def computed_up_to_a_late_second_item(producer, half):
    """A request of two items whose prompt is computed up to the second, which has not landed."""
    sched, manager = half()
    req = request("r1", [("a", 16), ("b", 16)], producer.endpoint)
    assert sched.ensure_cache_available(req, 0)
    producer.store.put("a", embedding(16, 1), claims=(claim_of("r1"),))
    assert steps_until(lambda: not sched.in_flight("a"))
    assert sched.ensure_cache_available(req, 5)
    step(sched, manager, req, 5, 19)  # the first item and the text after it
    return sched, manager, req


def test_a_cancel_while_a_late_item_is_in_flight_releases_everything(producer, half):
    sched, manager, req = computed_up_to_a_late_second_item(producer, half)
    sched.request_finished(req)  # the client went away
    assert sched.staging.stats()["used_bytes"] == 0 and not manager.preallocated and not sched._items
    assert steps_until(lambda: producer.store.settled("b", claim_of("r1")))  # the encoder was told
    assert not sched.in_flight("b") and can_allocate(manager, req, 1)  # vLLM is held back no more


def test_a_late_item_that_fails_fails_the_request_and_releases_everything(producer, half):
    sched, manager, req = computed_up_to_a_late_second_item(producer, half)
    producer.store.mark_failed("b", "the encoder could not encode it")
    # The next steps find it failed; vLLM then finishes the request with the error.
    assert steps_until(lambda: not sched.ensure_cache_available(req, 24) and "r1" in sched.take_unavailable())
    finished = sched.request_finished(req)
    assert finished.error
    assert sched.staging.stats()["used_bytes"] == 0 and not manager.preallocated and not sched._items


def test_a_request_with_its_own_seed_waits_for_every_item_on_cpu(producer, half):
    """vLLM 0.32's CPU worker cannot compute part of a seeded request's prompt (it winds the request's
    generator back, and a CPU generator has no offset: the engine dies). Such a request waits for all."""
    sched, _ = half()
    req = request("r1", [("a", 16), ("b", 16)], producer.endpoint)
    req.sampling_params = SimpleNamespace(seed=7)
    assert not sched.ensure_cache_available(req, 0)
    producer.store.put("a", embedding(16, 1), claims=(claim_of("r1"),))
    assert steps_until(lambda: not sched.in_flight("a"))
    assert not sched.ensure_cache_available(req, 0)
    producer.store.put("b", embedding(16, 2), claims=(claim_of("r1"),))
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    sched.request_finished(req)
