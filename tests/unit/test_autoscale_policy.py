"""The local autoscaler's decision (services/autoscale/policy.py), driven with made-up snapshots and times:
a role grows when the signal that says a request is late there stays high (encoders: items' queueing time;
LMs: TTFT and TPOT p90 against the objectives), gives instances away only while its own lateness would stay
well under its thresholds, within the budget, with hysteresis."""

from __future__ import annotations

import pytest

from services.autoscale.policy import Action, Budget, InstanceSignals, Policy, Snapshot, role_lateness

BUDGET = Budget(min_encoders=1, max_encoders=3, min_lms=1, max_lms=2, up_threshold=0.75, down_threshold=0.25,
                give_threshold=0.5, up_after_s=6, down_after_s=20, cooldown_s=30, encoder_wait_s=0.5,
                ttft_s=2.0, tpot_s=0.1)
GIB = 1 << 30


def enc(address: str, wait: float | None = 0.0, busy: float = 0.0, draining: bool = False, memory: int = 0):
    return InstanceSignals(address, draining=draining, queue_wait_s=wait, busy=busy, memory_bytes=memory)


def lm(address: str, ttft: float | None = 0.1, tpot: float | None = 0.01, memory: int = 0):
    return InstanceSignals(address, ttft_s=ttft, tpot_s=tpot, memory_bytes=memory)


def snap(encoders, lms=None) -> Snapshot:
    return Snapshot(encoders=list(encoders), lms=list(lms if lms is not None else [lm("l0", tpot=0.05)]))


def run(policy: Policy, snapshot: Snapshot, times) -> list[tuple[float, Action]]:
    return [(t, a) for t in times for a in policy.decide(snapshot, t)]


def test_encoders_late_on_queueing_time_grow_only_after_it_stayed_high_for_up_after_s():
    p = Policy(BUDGET)
    got = run(p, snap([enc("e0", wait=0.4)]), [0, 2, 4, 5.9, 6.0, 8])  # 0.4 s of a 0.5 s budget: 0.8
    assert got == [(6.0, Action("add", "encoder", reason="lateness 0.80 >= 0.75 for 6s"))]


def test_a_busy_encoder_whose_items_do_not_wait_is_not_late():
    p = Policy(BUDGET)
    assert role_lateness("encoder", snap([enc("e0", wait=0.05, busy=1.0)]), BUDGET) == pytest.approx(0.1)
    assert run(p, snap([enc("e0", wait=0.05, busy=1.0)]), range(0, 60, 2)) == []


def test_lms_are_late_on_the_worse_of_ttft_and_tpot_p90_against_their_objectives():
    assert role_lateness("lm", snap([], [lm("l0", ttft=1.0, tpot=0.09)]), BUDGET) == pytest.approx(0.9)
    assert role_lateness("lm", snap([], [lm("l0", ttft=1.8, tpot=0.02)]), BUDGET) == pytest.approx(0.9)
    p = Policy(BUDGET)
    late = snap([enc("e0")], [lm("l0", ttft=0.2, tpot=0.08)])  # TPOT p90 80 ms of 100: 0.8
    assert [(t, a.role) for t, a in run(p, late, range(0, 10))] == [(6, "lm")]


def test_instances_without_a_reading_are_left_out_and_a_role_with_none_reads_on_time():
    assert role_lateness("encoder", snap([enc("e0", wait=0.5), enc("e1", wait=None)]), BUDGET) == 1.0
    assert role_lateness("lm", snap([], [lm("l0", ttft=None, tpot=None)]), BUDGET) == 0.0
    assert role_lateness("lm", snap([], [lm("l0", ttft=None, tpot=0.05)]), BUDGET) == 0.5


def test_a_role_far_past_its_threshold_grows_by_several_up_to_max_step():
    b = Budget(max_encoders=10, max_step=3, up_after_s=0, cooldown_s=0)
    four = snap([enc(f"e{i}", wait=0.75) for i in range(4)])  # 1.5 = 2x the threshold: 4 more asked
    assert [a.count for a in Policy(b).decide(four, 0)] == [3]
    assert [a.count for a in Policy(Budget(max_encoders=5, max_step=3, up_after_s=0)).decide(four, 0)] == [1]


def test_a_blip_of_lateness_shorter_than_up_after_s_adds_nothing():
    p = Policy(BUDGET)
    high, low = snap([enc("e0", wait=0.5)]), snap([enc("e0", wait=0.2)])
    assert [a for t, s in [(0, high), (3, high), (5, low), (7, high), (12, high)] for a in p.decide(s, t)] == []
    assert p.decide(high, 13) != []  # high since 7


def test_after_a_change_the_role_cools_down_before_it_changes_again():
    p = Policy(BUDGET)
    assert run(p, snap([enc("e0", wait=1)]), [0, 6]) != []
    late2 = snap([enc("e0", wait=1), enc("e1", wait=1)])
    assert run(p, late2, range(7, 36)) == []  # cooling down (30 s from 6); late all along
    assert [t for t, _ in run(p, late2, range(36, 50))] == [36]


def test_never_more_than_the_maximum_nor_past_the_memory_budget():
    p = Policy(BUDGET)
    full = snap([enc(f"e{i}", wait=1) for i in range(3)])
    assert run(p, full, range(0, 60, 2)) == []
    tight = Policy(Budget(max_encoders=3, max_memory_gib=5))
    two = snap([enc("e0", wait=1, memory=2 * GIB), enc("e1", wait=1, memory=2 * GIB)], [lm("l0", tpot=0.15)])
    assert run(tight, two, range(0, 60, 2)) == []  # 4 GiB used + 2 GiB more > 5 GiB; the LM is late too
    roomy = Policy(Budget(max_encoders=3, max_memory_gib=6))
    assert [a.kind for _, a in run(roomy, two, range(0, 30, 2))] == ["add"]


def test_an_on_time_role_shrinks_after_down_after_s_taking_the_least_late_newest_instance():
    p = Policy(BUDGET)
    quiet = snap([enc("e0", wait=0.1), enc("e1", wait=0.0), enc("e2", wait=0.0)])
    got = run(p, quiet, range(0, 30))
    assert [(t, a.kind, a.address) for t, a in got] == [(20, "remove", "e2")]


def test_never_fewer_than_the_minimum():
    p = Policy(BUDGET)
    assert run(p, snap([enc("e0")]), range(0, 100, 5)) == []


def test_a_removal_that_would_leave_the_rest_past_the_down_threshold_is_not_made():
    b = Budget(up_threshold=0.5, down_threshold=0.3, give_threshold=0.3, down_after_s=0, cooldown_s=0,
               max_encoders=3)
    two = snap([enc("e0", wait=0.1), enc("e1", wait=0.1)])  # 0.2 each; one would carry 0.4 > 0.3
    assert run(Policy(b), two, range(10)) == []


def test_encoders_give_nothing_while_their_busy_share_with_one_fewer_would_leave_no_room():
    b = Budget(down_after_s=0, cooldown_s=0, max_encoders=3, encoder_busy_room=0.7)
    busy = snap([enc("e0", wait=0.0, busy=0.5), enc("e1", wait=0.0, busy=0.5)])  # 1.0 on one: no room
    assert run(Policy(b), busy, range(10)) == []
    light = snap([enc("e0", wait=0.0, busy=0.3), enc("e1", wait=0.0, busy=0.3)])
    assert [a.kind for a in Policy(b).decide(light, 0)] == ["remove"]


def test_a_late_role_at_the_memory_budget_takes_instances_the_other_role_can_spare():
    b = Budget(max_encoders=8, max_lms=8, max_memory_gib=8, up_after_s=0, down_after_s=100, cooldown_s=5,
               down_threshold=0.2, give_threshold=0.5, max_step=4)
    encoders = [enc(f"e{i}", wait=0.0, busy=0.2, memory=GIB) for i in range(4)]
    lms = [lm(f"l{i}", ttft=0.5, tpot=0.3, memory=GIB) for i in range(4)]  # TPOT 1.5x its 0.2 s: 4 more asked
    p = Policy(b)
    acts = p.decide(Snapshot(encoders, lms), 0)
    assert [(a.kind, a.role) for a in acts] == [("remove", "encoder")] * 2  # a third would leave 0.8 busy on one
    assert [a.address for a in acts] == ["e3", "e2"]  # all on time: the newest first
    assert p.decide(Snapshot(encoders, lms), 1) == []  # the encoders cool down


def test_a_role_gives_nothing_to_the_other_when_its_own_lateness_would_pass_give_threshold():
    b = Budget(max_encoders=4, max_lms=4, max_memory_gib=4, up_after_s=0, cooldown_s=0, give_threshold=0.5,
               max_step=2)
    encoders = [enc(f"e{i}", wait=0.3, memory=GIB) for i in range(2)]  # 0.6 already: nothing to give
    lms = [lm(f"l{i}", tpot=0.2, memory=GIB) for i in range(2)]
    assert Policy(b).decide(Snapshot(encoders, lms), 0) == []


def test_draining_instances_are_not_capacity_and_a_role_below_its_minimum_is_refilled():
    p = Policy(BUDGET)
    s = snap([enc("e0", wait=1, draining=True)])
    assert role_lateness("encoder", s, BUDGET) is None
    assert [(a.kind, a.role) for a in p.decide(s, 0)] == [("add", "encoder")]


def test_a_role_with_a_change_in_flight_is_skipped_and_its_timers_restart():
    p = Policy(BUDGET)
    late = snap([enc("e0", wait=1)])
    assert p.decide(late, 0, skip=frozenset({"encoder"})) == []
    assert p.decide(late, 10, skip=frozenset({"encoder"})) == []
    assert p.decide(late, 11) == [] and p.decide(late, 16) == []  # high since 11, not since 0
    assert [a.kind for a in p.decide(late, 17)] == ["add"]


@pytest.mark.parametrize("kwargs", [dict(min_encoders=0), dict(min_lms=3, max_lms=2),
                                    dict(down_threshold=0.8, up_threshold=0.7), dict(cooldown_s=-1),
                                    dict(give_threshold=0.9), dict(give_threshold=0.1), dict(down_threshold=0.6, up_threshold=0.6), dict(tpot_s=0),
                                    dict(max_step=0)])
def test_a_budget_that_cannot_hold_is_refused(kwargs):
    with pytest.raises(ValueError):
        Budget(**kwargs)


def test_the_gateway_is_given_the_autoscalers_objectives_and_the_users_own_flags_win():
    from services.cli import build_parser
    from services.common.config import from_args
    from services.gateway.config import GatewayConfig

    def gateway(*argv):
        return from_args(GatewayConfig, build_parser().parse_args(["gateway", "--lms", "lm:1", *argv]))

    args = Budget(ttft_s=1.5, tpot_s=0.05).gateway_args()
    assert args == ["--objective-ttft-ms=1500", "--objective-tpot-ms=50"]
    assert (gateway(*args).objective_ttft_ms, gateway(*args).objective_tpot_ms) == (1500, 50)
    assert gateway(*args, "--objective-ttft-ms", "900").objective_ttft_ms == 900  # epd up's --gateway-args come after
