"""The fleet simulator (``bench/sim``): deterministic, conserves requests, shows the colocated stall,
and keeps the autoscaler within its budget. Tiny traces only: each test runs in well under a second."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.unit.helpers import load_bench

plan = load_bench("plan")  # puts bench/ on the path for the sim package
from sim.autoscale import AutoscaleConfig, Autoscaler  # noqa: E402
from sim.costs import EncoderCost, LMCost, PathCost, Profile, load_profile, load_section  # noqa: E402
from sim.fleet import Fleet  # noqa: E402
from sim.trace import Trace, capacity_trace, day_trace  # noqa: E402

PROFILE = Profile(
    "test",
    EncoderCost(fixed_s=0.002, per_token_s=0.00002, max_batch=4),
    LMCost(step_s=0.006, per_seq_s=0.0001, per_prefill_token_s=0.00005, chunk_tokens=4096, max_seqs=16,
           kv_tokens=200_000, colo_per_item_s=0.002, colo_per_token_s=0.00002),
    PathCost(front_s=0.01, meta_s=0.005, preprocess_s=0.01, transfer_fixed_s=0.001, bytes_per_token=7168,
             transfer_bps=25e9),
)


def _trace(n: int = 200, rate: float = 40.0, share: float = 0.5, seed: int = 1) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    n_img = (rng.random(n) < share).astype(np.int64) * rng.integers(1, 3, n)
    return Trace(t, rng.integers(50, 400, n), n_img, np.full(n, 1200), rng.integers(20, 120, n))


def test_every_request_finishes_with_its_first_token_before_its_last():
    trace = _trace()
    for fleet in (Fleet(PROFILE, n_enc=2, n_lm=3), Fleet(PROFILE, n_lm=3, colocated=True)):
        res = fleet.run(trace)
        assert fleet.finished == len(trace)
        assert np.isfinite(res.ttft).all() and (res.ttft > 0).all()
        assert (res.tpot >= 0).all()
        assert res.end_s >= trace.t[-1]


def test_a_seed_gives_the_same_run_and_another_seed_another():
    cfg = load_section("day")
    a = day_trace(cfg, seed=3, scale=0.002)
    b = day_trace(cfg, seed=3, scale=0.002)
    c = day_trace(cfg, seed=4, scale=0.002)
    assert np.array_equal(a.t, b.t) and np.array_equal(a.out, b.out)
    assert len(a) != len(c) or not np.array_equal(a.t, c.t)
    ra = Fleet(PROFILE, n_enc=1, n_lm=2).run(a)
    rb = Fleet(PROFILE, n_enc=1, n_lm=2).run(b)
    assert np.array_equal(ra.ttft, rb.ttft) and np.array_equal(ra.tpot, rb.tpot)


def test_colocated_encodes_stall_the_decodes_that_split_encoders_do_not():
    # One long text stream decodes while small-image requests arrive through it (a 40 ms vision run
    # each, few tokens to prefill): colocated, every encode runs inside the LM's steps, so the text stream's time
    # per token grows; split, the encoders take them and it does not.
    profile = replace(PROFILE, lm=replace(PROFILE.lm, colo_per_item_s=0.04))
    n = 60
    t = np.concatenate([[0.0], 0.05 + 0.05 * np.arange(n - 1)])
    n_img = np.concatenate([[0], np.ones(n - 1, dtype=np.int64)])
    trace = Trace(t, np.full(n, 100), n_img, np.full(n, 64), np.concatenate([[400], np.full(n - 1, 4)]))
    colo = Fleet(profile, n_lm=1, colocated=True).run(trace)
    split = Fleet(profile, n_enc=4, n_lm=1).run(trace)
    assert colo.tpot[0] > 1.5 * split.tpot[0]


def test_the_autoscaler_moves_gpus_to_the_encoders_and_never_holds_more_than_its_budget():
    trace = _trace(n=3000, rate=300.0, share=0.9)
    budget = 8
    scaler = Autoscaler(AutoscaleConfig(tick_s=0.1, budget=budget, min_gpus=budget, cooldown_s=0.2))
    fleet = Fleet(PROFILE, n_enc=1, n_lm=budget - 1, autoscaler=scaler, provision_s=0.2)
    res = fleet.run(trace)
    assert fleet.finished == len(trace)
    assert max(h for _, _, _, h in res.timeline) <= budget
    assert max(e for _, e, _, _ in res.timeline) > 1  # it grew the encoders
    assert res.gpu_s <= budget * res.end_s + 1e-6


def test_the_capacity_workloads_match_the_benchmark():
    mixed = capacity_trace("mixed", 2.0, 30, 0, image_tokens=64, text_tokens=74, mixed_text_tokens=40, out_tokens=32)
    assert list(np.nonzero(mixed.n_img)[0]) == [9, 19, 29]  # every 10th, as bench/capacity.py writes it
    mm = capacity_trace("random-mm", 2.0, 30, 0, image_tokens=64, text_tokens=74, mixed_text_tokens=40, out_tokens=32)
    assert (mm.n_img == 1).all() and mm.t[0] == 0.0
    with pytest.raises(ValueError):
        capacity_trace("video", 1.0, 3, 0, image_tokens=1, text_tokens=1, mixed_text_tokens=1, out_tokens=1)


def test_every_input_figure_names_its_source():
    import json

    from sim.costs import INPUTS

    with open(INPUTS) as f:
        data = json.load(f)
    figures = [v for p in data["profiles"].values() for sec in ("encoder", "lm", "path") for v in p[sec].values()]
    figures += list(data["validation"].values()) + list(data["day"].values())
    assert figures and all(isinstance(v, dict) and v.get("source") for v in figures)
    for name in data["profiles"]:
        assert load_profile(name).lm.max_seqs > 0


def test_the_projects_own_policy_driven_in_the_simulator_stays_within_its_gpu_budget():
    from sim.local_policy import LocalPolicy

    from services.autoscale.policy import Budget

    trace = _trace(n=3000, rate=300.0, share=0.9)
    budget = 8
    scaler = LocalPolicy(Budget(min_encoders=1, max_encoders=budget - 1, min_lms=1, max_lms=budget - 1,
                                max_memory_gib=budget, up_after_s=0.2, down_after_s=0.6, cooldown_s=0.4),
                         tick_s=0.1)
    fleet = Fleet(PROFILE, n_enc=1, n_lm=4, autoscaler=scaler, provision_s=0.2)
    res = fleet.run(trace)
    assert fleet.finished == len(trace)
    assert max(h for _, _, _, h in res.timeline) <= budget
    assert any(what == "add encoder" for _, what, _ in scaler.actions)  # 90 % images: encoders grow


def test_the_local_policy_reads_queueing_time_and_latencies_as_deltas_between_ticks():
    from sim.local_policy import LocalPolicy

    from services.autoscale.policy import Budget

    fleet = Fleet(PROFILE, n_enc=2, n_lm=2)
    res = fleet.run(_trace(n=300, rate=200.0, share=0.9))
    waited = [e.waited for e in fleet.encoders]
    assert sum(n for _, n in waited) == fleet.waits["encoder"][1] > 0  # every item's wait, on its encoder
    assert sum(len(m.ttfts) for m in fleet.lms) == len(res.ttft)  # one TTFT per request, on its LM
    scaler = LocalPolicy(Budget(max_encoders=4, max_lms=4), tick_s=0.1)
    snap, _ = scaler.snapshot(fleet, res.end_s)
    assert all(i.ttft_s is not None for i in snap.lms) and all(not m.ttfts for m in fleet.lms)  # taken
    assert [i.queue_wait_s for i in snap.encoders] == [pytest.approx(t / n) for t, n in waited]
    again, _ = scaler.snapshot(fleet, res.end_s + 1)
    assert all(i.ttft_s is None and i.tpot_s is None for i in again.lms)  # nothing new since
    assert all(i.queue_wait_s is None for i in again.encoders)
