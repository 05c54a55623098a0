"""The local autoscaler's decision (services/autoscale/policy.py), driven with made-up snapshots and times:
it adds under sustained load and removes under sustained idleness, within the budget, with hysteresis."""

from __future__ import annotations

import pytest

from services.autoscale.policy import Action, Budget, InstanceSignals, Policy, Snapshot, role_load

BUDGET = Budget(min_encoders=1, max_encoders=3, min_lms=1, max_lms=2, up_threshold=0.75, down_threshold=0.25,
                up_after_s=6, down_after_s=20, cooldown_s=30)


def enc(address: str, busy: float = 0.0, queue: float = 0.0, draining: bool = False, memory: int = 0):
    return InstanceSignals(address, draining=draining, busy=busy, queue=queue, memory_bytes=memory)


def lm(address: str, running: float = 0.0, waiting: float = 0.0, slots: int = 4):
    return InstanceSignals(address, running=running, waiting=waiting, slots=slots)


def snap(encoders, lms=None) -> Snapshot:
    return Snapshot(encoders=list(encoders), lms=list(lms if lms is not None else [lm("l0", running=1)]))


def run(policy: Policy, snapshot: Snapshot, times) -> list[tuple[float, Action]]:
    return [(t, a) for t in times for a in policy.decide(snapshot, t)]


def test_a_busy_encoder_role_grows_only_after_the_load_stayed_high_for_up_after_s():
    p = Policy(BUDGET)
    got = run(p, snap([enc("e0", busy=0.9)]), [0, 2, 4, 5.9, 6.0, 8])
    assert got == [(6.0, Action("add", "encoder", reason="load 0.90 >= 0.75 for 6s"))]


def test_a_queue_counts_as_load_before_the_busy_share_is_high():
    assert role_load("encoder", snap([enc("e0", busy=0.3, queue=4)]), BUDGET) == 1.0
    assert role_load("lm", snap([], [lm("l0", running=2, waiting=2, slots=4), lm("l1")]), BUDGET) == 0.5


def test_a_blip_of_load_shorter_than_up_after_s_adds_nothing():
    p = Policy(BUDGET)
    high, low = snap([enc("e0", busy=0.9)]), snap([enc("e0", busy=0.5)])
    assert [a for t, s in [(0, high), (3, high), (5, low), (7, high), (12, high)] for a in p.decide(s, t)] == []
    assert p.decide(high, 13) != []  # high since 7


def test_after_a_change_the_role_cools_down_before_it_changes_again():
    p = Policy(BUDGET)
    assert run(p, snap([enc("e0", busy=1)]), [0, 6]) != []
    busy2 = snap([enc("e0", busy=1), enc("e1", busy=1)])
    assert run(p, busy2, range(7, 36)) == []  # cooling down (30 s from 6); high all along
    assert [t for t, _ in run(p, busy2, range(36, 50))] == [36]


def test_never_more_than_the_maximum_nor_past_the_memory_budget():
    p = Policy(BUDGET)
    full = snap([enc(f"e{i}", busy=1) for i in range(3)])
    assert run(p, full, range(0, 60, 2)) == []
    gib = 1 << 30
    tight = Policy(Budget(max_encoders=3, max_memory_gib=5))
    two = snap([enc("e0", busy=1, memory=2 * gib), enc("e1", busy=1, memory=2 * gib)], [lm("l0")])
    assert run(tight, two, range(0, 60, 2)) == []  # 4 GiB used + 2 GiB more > 5 GiB
    roomy = Policy(Budget(max_encoders=3, max_memory_gib=6))
    assert [a.kind for _, a in run(roomy, two, range(0, 30, 2))] == ["add"]


def test_an_idle_role_shrinks_after_down_after_s_taking_the_least_busy_newest_instance():
    p = Policy(BUDGET)
    idle = snap([enc("e0", busy=0.1), enc("e1", busy=0.0), enc("e2", busy=0.0)])
    got = run(p, idle, range(0, 30))
    assert [(t, a.kind, a.address) for t, a in got] == [(20, "remove", "e2")]


def test_never_fewer_than_the_minimum():
    p = Policy(BUDGET)
    assert run(p, snap([enc("e0")]), range(0, 100, 5)) == []


def test_a_removal_that_would_push_the_rest_over_the_up_threshold_is_not_made():
    b = Budget(up_threshold=0.5, down_threshold=0.3, down_after_s=0, cooldown_s=0, max_encoders=3)
    p = Policy(b)
    two = snap([enc("e0", busy=0.3), enc("e1", busy=0.3)])  # one would carry 0.6 >= 0.5
    assert run(p, two, range(10)) == []


def test_draining_instances_are_not_capacity_and_a_role_below_its_minimum_is_refilled():
    p = Policy(BUDGET)
    s = snap([enc("e0", busy=1, draining=True)])
    assert role_load("encoder", s, BUDGET) is None
    assert [(a.kind, a.role) for a in p.decide(s, 0)] == [("add", "encoder")]


def test_a_role_with_a_change_in_flight_is_skipped_and_its_timers_restart():
    p = Policy(BUDGET)
    busy = snap([enc("e0", busy=1)])
    assert p.decide(busy, 0, skip=frozenset({"encoder"})) == []
    assert p.decide(busy, 10, skip=frozenset({"encoder"})) == []
    assert p.decide(busy, 11) == [] and p.decide(busy, 16) == []  # high since 11, not since 0
    assert [a.kind for a in p.decide(busy, 17)] == ["add"]


def test_lms_scale_on_running_plus_waiting_over_their_slots():
    p = Policy(BUDGET)
    full = snap([enc("e0", busy=0.5)], [lm("l0", running=4, waiting=3, slots=4)])
    assert [(t, a.role) for t, a in run(p, full, range(0, 10))] == [(6, "lm")]


@pytest.mark.parametrize("kwargs", [dict(min_encoders=0), dict(min_lms=3, max_lms=2),
                                    dict(down_threshold=0.8, up_threshold=0.7), dict(cooldown_s=-1)])
def test_a_budget_that_cannot_hold_is_refused(kwargs):
    with pytest.raises(ValueError):
        Budget(**kwargs)
