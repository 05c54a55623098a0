"""Gateway routing (rendezvous affinity with spill, least outstanding) and the
instance pool's DNS refresh, driven without servers."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

from epd.encoder.v1 import encoder_pb2_grpc
from services.gateway.instances import InstancePool, InstanceState, is_ip, join_host_port, resolve, split_host_port
from services.gateway.routing import LeastOutstanding, pick_decode, pick_encoder

pytestmark = pytest.mark.unit

KEYS = [f"{i:064x}" for i in range(1000)]


def insts(*addresses: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(address=a, outstanding=0) for a in addresses]


FOUR = [f"10.0.0.{i}:50051" for i in range(1, 5)]


# --- pick_encoder ------------------------------------------------------------------------------------------------


def test_pick_encoder_is_deterministic_and_independent_of_candidate_order():
    a, b = insts(*FOUR), insts(*reversed(FOUR))
    for key in KEYS[:200]:
        first = pick_encoder(key, a, spill=4).address
        assert pick_encoder(key, a, spill=4).address == first
        assert pick_encoder(key, b, spill=4).address == first  # fresh objects, other order


def test_an_encoder_that_holds_the_output_wins_within_the_spill_bound():
    """Issue 33: the item's output sits in one encoder's store or host tier (its Holdings): that encoder,
    not the affine one, unless it is more than ``spill`` calls busier than the least busy."""
    cands = insts(*FOUR)
    key = KEYS[0]
    affine = pick_encoder(key, cands, spill=4)
    holder = next(c for c in cands if c is not affine)
    holds = lambda address: address == holder.address  # noqa: E731
    assert pick_encoder(key, cands, spill=4, holds=holds) is holder
    holder.outstanding = 5  # the others are idle: 5 > 4 beyond the least busy
    assert pick_encoder(key, cands, spill=4, holds=holds) is affine
    assert pick_encoder(key, cands, spill=4, holds=lambda a: False) is affine  # nobody holds it: affinity


def test_a_holder_keeps_the_image_longer_than_affinity_does():
    """``held_spill``: the holder costs no vision run, any other encoder a whole one, so it keeps the image
    up to its own bound (the gateway's --held-spill, 16 by default), then load wins."""
    cands = insts(*FOUR)
    key = KEYS[0]
    affine = pick_encoder(key, cands, spill=4)
    holder = next(c for c in cands if c is not affine)
    holds = lambda address: address == holder.address  # noqa: E731
    holder.outstanding = 16
    assert pick_encoder(key, cands, spill=4, holds=holds, held_spill=16) is holder
    holder.outstanding = 17
    assert pick_encoder(key, cands, spill=4, holds=holds, held_spill=16) is affine
    affine.outstanding = 5  # and affinity still spills past its own bound
    least = pick_encoder(key, cands, spill=4, holds=holds, held_spill=16)
    assert least not in (holder, affine) and least.outstanding == 0


def test_pick_encoder_without_candidates_is_none():
    assert pick_encoder("abc", [], spill=4) is None


def test_pick_encoder_spreads_keys_roughly_evenly():
    cands = insts(*FOUR)
    counts = collections.Counter(pick_encoder(k, cands, spill=4).address for k in KEYS)
    assert set(counts) == set(FOUR)
    for address, n in counts.items():
        assert 150 <= n <= 350, (address, counts)


def test_removing_an_instance_moves_only_its_own_keys():
    cands = insts(*FOUR)
    before = {k: pick_encoder(k, cands, spill=4).address for k in KEYS}
    gone = FOUR[2]
    after = {k: pick_encoder(k, [c for c in cands if c.address != gone], spill=4).address for k in KEYS}
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == gone}
    assert 150 <= len(moved) <= 350
    # The moved keys spread over the survivors rather than all landing on one.
    assert len({after[k] for k in moved}) == 3


def test_adding_an_instance_moves_keys_only_onto_the_new_one():
    cands = insts(*FOUR)
    before = {k: pick_encoder(k, cands, spill=4).address for k in KEYS}
    new = "10.0.0.5:50051"
    after = {k: pick_encoder(k, cands + insts(new), spill=4).address for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == new for k in moved)
    assert 120 <= len(moved) <= 300  # ~1/5


def _affine(key: str, cands) -> SimpleNamespace:
    saved = [c.outstanding for c in cands]
    for c in cands:
        c.outstanding = 0
    try:
        return pick_encoder(key, cands, spill=0)
    finally:
        for c, n in zip(cands, saved):
            c.outstanding = n


@pytest.mark.parametrize("spill", [0, 1, 4])
def test_spills_to_the_least_loaded_only_beyond_spill_extra_calls(spill):
    cands = insts(*FOUR)
    for key in KEYS[:50]:
        affine = _affine(key, cands)
        others = [c for c in cands if c is not affine]
        for c in cands:
            c.outstanding = 2
        affine.outstanding = 2 + spill  # exactly `spill` more: stays
        assert pick_encoder(key, cands, spill) is affine
        affine.outstanding = 2 + spill + 1  # one more: spills
        got = pick_encoder(key, cands, spill)
        assert got is not affine and got.outstanding == 2
        # Spilling goes to the least loaded, not just any other.
        others[0].outstanding, others[1].outstanding = 5 + spill, 1
        others[2].outstanding = 3
        assert pick_encoder(key, cands, spill) is others[1]


def test_no_spill_while_every_instance_is_equally_busy():
    cands = insts(*FOUR)
    for c in cands:
        c.outstanding = 50
    for key in KEYS[:50]:
        assert pick_encoder(key, cands, spill=0) is _affine(key, cands)


# --- LeastOutstanding --------------------------------------------------------------------------------------------


def test_least_outstanding_picks_the_minimum():
    policy = LeastOutstanding()
    a, b, c = insts("a:1", "b:1", "c:1")
    a.outstanding, b.outstanding, c.outstanding = 3, 0, 1
    assert all(policy.pick([a, b, c]) is b for _ in range(10))
    assert policy.pick([]) is None


def test_least_outstanding_breaks_ties_by_the_requests_key():
    """The same key always lands on the same tied instance (whichever process asks); different keys
    spread over the ties."""
    policy = LeastOutstanding()
    cands = insts("a:1", "b:1", "c:1")
    assert all(policy.pick(cands, k).address == policy.pick(list(reversed(cands)), k).address for k in KEYS[:30])
    assert {policy.pick(cands, k).address for k in KEYS[:30]} == {"a:1", "b:1", "c:1"}
    cands[1].outstanding = 1  # b is busier: a and c share the picks
    picks = collections.Counter(policy.pick(cands, k).address for k in KEYS[:30])
    assert set(picks) == {"a:1", "c:1"} and min(picks.values()) >= 5


# --- addresses ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry, host, port", [
    ("10.0.0.1:50051", "10.0.0.1", 50051),
    ("enc.default.svc:7000", "enc.default.svc", 7000),
    ("[::1]:50051", "::1", 50051),
    ("[fd00::a:1]:9", "fd00::a:1", 9),
])
def test_split_and_join_host_port_round_trip(entry, host, port):
    assert split_host_port(entry) == (host, port)
    assert join_host_port(host, port) == entry


@pytest.mark.parametrize("entry", ["10.0.0.1", "host:", ":50051", "host:http", ""])
def test_split_host_port_rejects_entries_without_host_and_port(entry):
    with pytest.raises(ValueError):
        split_host_port(entry)


def test_is_ip():
    assert is_ip("127.0.0.1") and is_ip("::1") and is_ip("fd00::1")
    assert not is_ip("localhost") and not is_ip("[::1]")


def test_resolve_returns_ip_port_strings():
    assert asyncio.run(resolve("127.0.0.1", 50051)) == ["127.0.0.1:50051"]
    assert asyncio.run(resolve("::1", 50051)) == ["[::1]:50051"]


# --- InstancePool.refresh_dns ------------------------------------------------------------------------------------


class FakeResolver:
    """``answers[host]``: a list of addresses, or an exception to raise."""

    def __init__(self, **answers) -> None:
        self.answers = {k.replace("_", "."): v for k, v in answers.items()}
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        answer = self.answers[host]
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


def _pool(entries: list[str], resolver: FakeResolver) -> InstancePool:
    return InstancePool("encoder", entries, encoder_pb2_grpc.EncoderServiceStub, resolver=resolver)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_refresh_dns_adds_and_removes_instances_of_a_host_name_and_keeps_ip_literals():
    async def body():
        r = FakeResolver(enc_svc=["10.1.0.1:50051", "10.1.0.2:50051"])
        pool = _pool(["enc.svc:50051", "10.0.0.9:50051"], r)
        try:
            assert set(pool.instances) == {"10.0.0.9:50051"}  # literals exist before any lookup
            static = pool.instances["10.0.0.9:50051"]
            await pool.refresh_dns()
            assert r.calls == [("enc.svc", 50051)]  # the literal is never looked up
            assert set(pool.instances) == {"10.0.0.9:50051", "10.1.0.1:50051", "10.1.0.2:50051"}
            assert pool.instances["10.1.0.1:50051"].source == "enc.svc:50051"
            assert static.source == "10.0.0.9:50051"
            kept = pool.instances["10.1.0.2:50051"]
            kept.outstanding = 3

            r.answers["enc.svc"] = ["10.1.0.2:50051", "10.1.0.3:50051"]
            await pool.refresh_dns()
            assert set(pool.instances) == {"10.0.0.9:50051", "10.1.0.2:50051", "10.1.0.3:50051"}
            assert pool.instances["10.1.0.2:50051"] is kept and kept.outstanding == 3  # not re-created
            assert pool.instances["10.0.0.9:50051"] is static

            r.answers["enc.svc"] = []
            await pool.refresh_dns()
            assert set(pool.instances) == {"10.0.0.9:50051"}
            kept.outstanding = 0
        finally:
            await pool.close()

    run(body())


def test_a_failed_lookup_keeps_the_previous_instances():
    async def body():
        r = FakeResolver(enc_svc=["10.1.0.1:50051", "10.1.0.2:50051"])
        pool = _pool(["enc.svc:50051"], r)
        try:
            await pool.refresh_dns()
            before = dict(pool.instances)
            r.answers["enc.svc"] = OSError("Temporary failure in name resolution")
            await pool.refresh_dns()
            assert pool.instances == before
            assert len(r.calls) == 2
        finally:
            await pool.close()

    run(body())


def test_a_host_never_resolved_is_dialed_by_name_until_it_resolves():
    async def body():
        r = FakeResolver(enc_svc=OSError("no such host"))
        pool = _pool(["enc.svc:50051"], r)
        try:
            await pool.refresh_dns()
            assert set(pool.instances) == {"enc.svc:50051"}
            await pool.refresh_dns()  # still failing: still one instance, not two
            assert set(pool.instances) == {"enc.svc:50051"}
            r.answers["enc.svc"] = ["10.1.0.1:50051"]
            await pool.refresh_dns()
            assert set(pool.instances) == {"10.1.0.1:50051"}
        finally:
            await pool.close()

    run(body())


def test_ipv6_literals_stay_static_and_resolved_ipv6_addresses_are_bracketed():
    async def body():
        r = FakeResolver(dual_svc=[join_host_port("fd00::1", 50051), join_host_port("10.1.0.1", 50051)])
        pool = _pool(["[::1]:50051", "dual.svc:50051"], r)
        try:
            assert set(pool.instances) == {"[::1]:50051"}
            await pool.refresh_dns()
            assert r.calls == [("dual.svc", 50051)]
            assert set(pool.instances) == {"[::1]:50051", "[fd00::1]:50051", "10.1.0.1:50051"}
            assert pool.instances["[fd00::1]:50051"].source == "dual.svc:50051"
            assert split_host_port("[fd00::1]:50051") == ("fd00::1", 50051)
            r.answers["dual.svc"] = ["10.1.0.1:50051"]
            await pool.refresh_dns()
            assert set(pool.instances) == {"[::1]:50051", "10.1.0.1:50051"}
        finally:
            await pool.close()

    run(body())


def test_healthy_leaves_out_ejected_and_excluded_instances():
    async def body():
        pool = _pool(["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], FakeResolver())
        try:
            a, b, c = pool.instances.values()
            for inst in (a, b, c):
                pool.admit(inst)
            pool.eject(b, "test")
            assert [i.address for i in pool.healthy()] == [a.address, c.address]
            assert [i.address for i in pool.healthy({a.address})] == [c.address]
            assert not b.healthy and b.reason == "test"
            assert pool.ejected() == [b] and pool.ejected({b.address}) == []
        finally:
            await pool.close()

    run(body())


def test_a_new_instance_is_pending_until_admitted_and_a_failure_leaves_it_pending_not_ejected():
    async def body():
        pool = _pool(["10.0.0.1:1"], FakeResolver())
        try:
            (a,) = pool.instances.values()
            assert (a.state, a.healthy, pool.healthy()) == (InstanceState.PENDING, False, [])
            pool.eject(a, "health check failed: UNAVAILABLE")
            assert a.state is InstanceState.PENDING and a.reason == "health check failed: UNAVAILABLE"
            assert pool.ejected() == []  # never admitted: not a fallback either
            pool.admit(a)
            assert (a.state, a.reason, pool.healthy()) == (InstanceState.ADMITTED, "", [a])
            pool.eject(a, "gone")
            assert a.state is InstanceState.EJECTED
        finally:
            await pool.close()

    run(body())


def test_a_refused_instance_is_never_routed_to_and_failures_keep_it_refused():
    async def body():
        pool = _pool(["10.0.0.1:1"], FakeResolver())
        try:
            (a,) = pool.instances.values()
            pool.refuse(a, "serves model 'b', not 'a'")
            assert (a.state, pool.healthy(), pool.ejected()) == (InstanceState.REFUSED, [], [])
            pool.eject(a, "health check failed: UNAVAILABLE")
            assert a.state is InstanceState.REFUSED and pool.ejected() == []
            pool.admit(a)
            with pytest.raises(AssertionError, match="ADMITTED -> REFUSED"):
                pool.refuse(a, "only a check of an instance that is not admitted verifies it")
        finally:
            await pool.close()

    run(body())


def _lm(address: str, outstanding: int = 0):
    return SimpleNamespace(address=address, outstanding=outstanding)


def test_the_decode_lm_is_one_on_the_prefill_lms_host_among_the_least_busy():
    policy = LeastOutstanding()
    p = _lm("10.0.0.1:50052")
    far, near = _lm("10.0.0.2:50052"), _lm("10.0.0.1:50053")
    assert all(pick_decode(p, [far, near], policy) is near for _ in range(4))
    near.outstanding = 1  # busier: load wins over locality
    assert pick_decode(p, [far, near], policy) is far
    v6 = _lm("[fd00::1]:50052")
    assert pick_decode(v6, [far, _lm("[fd00::1]:50053")], policy).address == "[fd00::1]:50053"
    assert pick_decode(p, [], policy) is None
