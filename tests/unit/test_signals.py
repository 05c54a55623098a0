"""The scaling signals' pure parts: the gateway's windowed attainment of its latency objectives
(``services.gateway.objectives``), the encoder's queue depth and busy seconds (``services.encoder.signals``)
and the LM's count of requests waiting for encoder outputs (``services.lm.signals``), each driven with its
own clock or contexts, and read back through the process's Prometheus registry as a scrape reads them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.encoder.signals import LOAD, EncoderLoad
from services.gateway import metrics
from services.gateway.objectives import OBJECTIVES, AttainmentWindow, Objectives, configure
from services.gateway.values import Timings
from services.lm.signals import WAITING, WaitingForItems

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def call(submitted: bool = False, with_items: bool = True) -> SimpleNamespace:
    """What ``waits_for_items`` reads of an LM call's ``RequestContext`` (which imports torch)."""
    return SimpleNamespace(sources={"img": object()} if with_items else {}, submitted=submitted, first_token_at=0.0)


def sample(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


# -- the gateway's objectives -------------------------------------------------------------------------------


def test_an_empty_window_meets_every_objective():
    counts = AttainmentWindow(clock=Clock()).counts()
    assert counts.requests == 0
    assert [counts.share(o) for o in ("ttft", "tpot", "both")] == [1.0, 1.0, 1.0]


def test_attainment_is_the_share_of_requests_that_met_each_objective_and_both():
    window = AttainmentWindow(60, ttft_ms=100, tpot_ms=10, clock=Clock())
    window.record(50, 5)     # meets both
    window.record(150, 5)    # misses ttft
    window.record(50, 20)    # misses tpot
    window.record(100, 10)   # on the objective: met
    counts = window.counts()
    assert (counts.requests, counts.ttft, counts.tpot, counts.both) == (4, 3, 3, 2)
    assert (counts.share("ttft"), counts.share("tpot"), counts.share("both")) == (0.75, 0.75, 0.5)


def test_requests_leave_the_window_as_it_slides_and_the_share_recovers():
    clock = Clock()
    window = AttainmentWindow(10, ttft_ms=100, tpot_ms=10, clock=clock)
    window.record(500, 1)  # a miss at t=1000
    clock.now += 5
    window.record(50, 1)   # a hit at t=1005
    assert window.counts().share("ttft") == 0.5
    clock.now += 6         # t=1011: the miss is more than 10 s old
    assert (window.counts().requests, window.counts().share("ttft")) == (1, 1.0)
    clock.now += 10        # t=1021: both gone
    assert window.counts().requests == 0 and window.counts().share("both") == 1.0


def test_the_window_keeps_one_bucket_per_second_whatever_the_rate():
    clock = Clock()
    window = AttainmentWindow(5, clock=clock)
    for i in range(5000):  # 500 requests a second for 10 s
        clock.now = 1000 + i / 500
        window.record(10, 1)
    assert len(window._buckets) <= 5
    assert 2000 <= window.counts().requests <= 2500


@pytest.mark.parametrize("kw", [{"window_s": 0.5}, {"ttft_ms": 0}, {"tpot_ms": -1}])
def test_a_window_refuses_settings_it_cannot_count(kw):
    with pytest.raises(ValueError):
        AttainmentWindow(**kw)


def test_objectives_publish_the_attainment_gauges_and_the_counts_behind_them():
    clock = Clock()
    objectives = Objectives(AttainmentWindow(60, ttft_ms=100, tpot_ms=10, clock=clock))
    objectives.observe(500, 1)
    objectives.observe(50, 1)
    assert sample("epd_gateway_objective_attainment", objective="ttft") == 0.5
    assert sample("epd_gateway_objective_attainment", objective="tpot") == 1.0
    assert sample("epd_gateway_objective_window_requests") == 2
    assert sample("epd_gateway_objective_window_met", objective="both") == 1
    clock.now += 120
    objectives.publish()  # what the gateway's task does every second
    assert sample("epd_gateway_objective_attainment", objective="ttft") == 1.0
    assert sample("epd_gateway_objective_window_requests") == 0


def test_the_gateway_counts_each_successful_finished_request_against_its_objectives():
    configure(60, ttft_ms=100, tpot_ms=10)
    try:
        metrics.observe("chat", 200, Timings(ttft_ms=500, tpot_ms=1, total_ms=600), media=0)
        metrics.observe("chat", 200, Timings(ttft_ms=50, tpot_ms=1, total_ms=60), media=0)
        metrics.observe("chat", 503, Timings(ttft_ms=0, total_ms=5), media=0)  # not a finished answer: not counted
        assert OBJECTIVES.window.counts().requests == 2
        assert sample("epd_gateway_objective_attainment", objective="ttft") == 0.5
    finally:
        configure(60, 2000, 200)


# -- the encoder's load ---------------------------------------------------------------------------------------


def test_the_queue_depth_counts_admitted_items_until_each_call_is_done_once():
    load = EncoderLoad(clock=Clock())
    a, b = load.admit(3), load.admit(1)
    assert load.depth == 4
    a.done()
    a.done()  # the handler's finally after an early done gives nothing back twice
    assert load.depth == 1
    b.done()
    assert load.depth == 0


def test_a_calls_wait_in_front_of_the_engine_is_counted_once_when_its_engine_request_starts():
    clock = Clock()
    load = EncoderLoad(clock=clock)
    a, b, never = load.admit(2), load.admit(1), load.admit(1)
    clock.now += 0.3
    a.started()
    clock.now += 0.5
    b.started()
    a.started()  # once
    never.done()  # refused before its engine request: no wait counted
    assert (load.wait_seconds, load.started) == (pytest.approx(0.3 + 0.8), 2)


def test_busy_seconds_grow_while_any_request_runs_and_overlaps_count_once():
    clock = Clock()
    load = EncoderLoad(clock=clock)
    with load.running():
        clock.now += 2
        assert load.busy_seconds() == 2  # read mid-run, as a scrape reads it
        with load.running():
            clock.now += 3
        clock.now += 1
    clock.now += 10  # idle
    assert load.busy_seconds() == 6
    with pytest.raises(RuntimeError), load.running():
        clock.now += 1
        raise RuntimeError("a failed encode still ends its busy stretch")
    assert load.busy_seconds() == 7 and load._running == 0


def test_the_encoder_scrape_reads_the_process_load():
    before = sample("epd_encoder_busy_seconds_total")
    started = sample("epd_encoder_engine_requests_total")
    pending = LOAD.admit(2)
    try:
        assert sample("epd_encoder_queue_depth") == 2
        pending.started()
        assert sample("epd_encoder_engine_requests_total") == started + 1
        assert sample("epd_encoder_service_wait_seconds_total") >= 0
        with LOAD.running():
            mid = sample("epd_encoder_busy_seconds_total")
        assert before <= mid <= sample("epd_encoder_busy_seconds_total")
    finally:
        pending.done()
    assert sample("epd_encoder_queue_depth") == 0


# -- the LM's requests waiting for items ----------------------------------------------------------------------


def test_a_request_waits_for_items_from_its_submission_until_its_first_token():
    waiting = WaitingForItems()
    with_items, text_only = call(), call(with_items=False)
    for ctx in (with_items, text_only):
        waiting.track(ctx)
    assert waiting.count() == 0  # not in the engine yet
    with_items.submitted = text_only.submitted = True
    assert waiting.count() == 1  # a text-only request waits for no encoder
    with_items.first_token_at = 12.5
    assert waiting.count() == 0
    with_items.first_token_at = 0.0
    waiting.forget(with_items)
    waiting.forget(with_items)  # forgetting twice is harmless
    assert waiting.count() == 0


def test_the_lm_scrape_reads_the_process_count():
    ctx = call(submitted=True)
    WAITING.track(ctx)
    try:
        assert sample("epd_lm_waiting_for_items") == 1
    finally:
        WAITING.forget(ctx)
    assert sample("epd_lm_waiting_for_items") == 0


def test_draining_is_one_gauge_for_both_services():
    from services.common.signals import DRAINING
    from services.encoder import signals as encoder
    from services.lm import signals as lm

    assert encoder.DRAINING is lm.DRAINING is DRAINING
    assert sample("epd_instance_draining") == 0
