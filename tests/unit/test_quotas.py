"""Per-tenant quotas from the keys file, each where it is enforced (no servers): admission's
``max_in_flight``, ``max_queue`` and ``images_per_minute``, a speech upload's windows included
(services.gateway.admission), background work's share by weight and ``max_background``
(services.gateway.background), the body budget's fair share and ``body_mib``,
and the gRPC readers' per-connection cap (services.gateway.intake). Over a quota is 429 with a
Retry-After, never 503; the other tenants keep their room."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from types import SimpleNamespace

import pytest

from services.gateway.admission import Admission, AdmissionRefused, ItemRate
from services.gateway.background import BackgroundWork
from services.gateway.config import GatewayConfig
from services.gateway.intake import GRPC_READERS, GRPC_READERS_PER_CONNECTION, BodyRefused, Intake
from services.gateway.tenants import Tenant, Tenants
from tests.unit.test_admission import cancel_all, queued, settle

pytestmark = pytest.mark.unit

MIB = 1 << 20


def quotas(**by_tenant: Tenant):
    """A ``Tenants.quota`` stand-in: the given tenants' quotas, no limits for any other."""
    return lambda name: by_tenant.get(name) or Tenant(name)


def admission(lm_slots: int = 8, queue: int = 4, clock=None, **by_tenant: Tenant) -> Admission:
    extra = {} if clock is None else {"clock": clock}
    return Admission(lm_slots, 0, queue, 30.0, healthy_lms=lambda: 1, healthy_encoders=lambda: 0,
                     quota=quotas(**by_tenant), **extra)


async def refused(adm: Admission, tenant: str, items: int = 0) -> AdmissionRefused:
    with pytest.raises(AdmissionRefused) as e:
        await asyncio.wait_for(adm.admit(False, tenant, items=items), 1)
    return e.value


# --- admission ----------------------------------------------------------------------------------------------------


def test_a_tenant_at_its_max_in_flight_is_refused_429_at_once_while_another_tenant_is_admitted():
    async def main():
        adm = admission(a=Tenant("a", max_in_flight=2))
        held = [await adm.admit(False, "a") for _ in range(2)]
        e = await refused(adm, "a")  # room is there (8 slots), the tenant's quota is not
        assert e.status == 429 and e.retry_after_s >= 1 and "tenant a" in e.message and "max_in_flight" in e.message
        other = [await asyncio.wait_for(adm.admit(False, "b"), 1) for _ in range(3)]
        held[0].release()
        again = await asyncio.wait_for(adm.admit(False, "a"), 1)  # one of its own ended: room again
        for t in [held[1], again, *other]:
            t.release()
        assert adm.in_flight == 0

    asyncio.run(main())


def test_a_waiter_of_a_tenant_that_reached_its_max_in_flight_is_passed_over_until_one_of_its_own_ends():
    async def main():
        adm = admission(lm_slots=6, a=Tenant("a", max_in_flight=2))
        a1 = await adm.admit(False, "a")
        b = [await adm.admit(False, "b") for _ in range(5)]  # full
        aw1, aw2 = await queued(adm, tenant="a"), await queued(adm, tenant="a")  # a has 1 of its 2: it may queue
        bw = await queued(adm, tenant="b")
        b[0].release()
        await settle()
        assert aw1.done() and adm.held_by("a") == 2  # a had fewer in flight: its turn
        b[1].release()
        await settle()
        # a has fewer in flight than b still, but it is at its quota: the room goes to b's waiter.
        assert bw.done() and not aw2.done() and adm.held_by("a") == 2
        a1.release()  # one of a's own ends: its waiter's turn
        await settle()
        assert aw2.done() and adm.held_by("a") == 2
        for t in [*b[2:], await aw1, await aw2, await bw]:
            t.release()
        assert adm.in_flight == 0 and adm.waiting == 0

    asyncio.run(main())


def test_max_queue_sets_a_tenants_queue_length_in_place_of_admission_queue():
    async def main():
        adm = admission(lm_slots=1, queue=1, a=Tenant("a", max_queue=3), b=Tenant("b", max_queue=0))
        held = await adm.admit(False, "c")
        a_waiting = [await queued(adm, tenant="a") for _ in range(3)]  # three, past --admission-queue's one
        e = await refused(adm, "a")
        assert e.status == 429 and "max_queue" in e.message
        e = await refused(adm, "b")  # a queue of none
        assert e.status == 429 and "tenant b" in e.message
        c_waiting = await queued(adm, tenant="c")  # a tenant without the quota: --admission-queue
        e = await refused(adm, "c")
        assert e.status == 429 and "--admission-queue" in e.message
        await cancel_all(*a_waiting, c_waiting)
        held.release()
        assert adm.in_flight == 0 and adm.waiting == 0

    asyncio.run(main())


def test_images_per_minute_admits_a_minutes_worth_of_items_then_429_until_the_bucket_refills():
    now = [1000.0]
    rate = ItemRate(clock=lambda: now[0])
    assert rate.take("a", 4, 6) == 0.0
    assert rate.take("a", 3, 6) == pytest.approx(10.0)  # 2 left: one more item in 10 s (6 a minute)
    assert rate.take("b", 6, 6) == 0.0  # each tenant its own bucket
    now[0] += 10.0
    assert rate.take("a", 3, 6) == 0.0
    assert rate.take("a", 7, 6) == math.inf  # more than a minute's worth: never
    now[0] += 3600.0
    assert rate.take("a", 6, 6) == 0.0  # refilled to a minute's worth, not more

    async def main():
        adm = admission(clock=lambda: now[0], a=Tenant("a", images_per_minute=4))
        tickets = [await adm.admit(False, "a", items=2) for _ in range(2)]
        e = await refused(adm, "a", items=1)
        assert e.status == 429 and "images_per_minute" in e.message and e.retry_after_s == 15
        tickets.append(await adm.admit(False, "a"))  # a request without media is not counted
        tickets.append(await adm.admit(False, "b", items=50))  # nor is a tenant without the quota limited
        e = await refused(adm, "a", items=5)
        assert e.status == 429 and e.retry_after_s == 60
        now[0] += 15.0
        tickets.append(await adm.admit(False, "a", items=1))
        for t in tickets:
            t.release()

    asyncio.run(main())


def test_items_of_a_request_that_is_not_admitted_are_given_back():
    async def main():
        now = [0.0]
        adm = admission(lm_slots=1, queue=0, clock=lambda: now[0], a=Tenant("a", images_per_minute=3))
        held = await adm.admit(False, "b")
        e = await refused(adm, "a", items=3)  # the queue is full: not admitted, its items stay
        assert "--admission-queue" in e.message
        held.release()
        (await adm.admit(False, "a", items=3)).release()

    asyncio.run(main())


# --- background work ---------------------------------------------------------------------------------------------


def test_max_background_limits_a_tenants_background_responses_and_not_another_tenants():
    lm = SimpleNamespace(track=contextlib.nullcontext)
    work = BackgroundWork(lambda: SimpleNamespace(instances={"lm:1": lm}), per_lm=0, timeout_s=60.0, generating_lms=lambda: 1,
                          quota=quotas(a=Tenant("a", max_background=1), z=Tenant("z", max_background=0)))

    async def main():
        adm = admission()
        work._until_ended = lambda *a: asyncio.Event().wait()  # the LM keeps working until cancelled
        ticket = await adm.admit(False, "a")
        place = work.reserve("a")
        with pytest.raises(AdmissionRefused) as e:  # reserved, not yet held: counted already
            work.reserve("a")
        assert e.value.status == 429 and e.value.retry_after_s >= 1 and "max_background" in e.value.message
        work.hold("resp_1", "lm:1", ticket)  # its LM accepted it (Admitted.close): the watcher holds it
        place.release()
        await settle()
        assert work.held_by("a") == 1
        with pytest.raises(AdmissionRefused):
            work.reserve("a")
        work.reserve("b").release()  # another tenant has room
        with pytest.raises(AdmissionRefused):
            work.reserve("z")  # none at all
        await work.close()
        assert work.held_by("a") == 0 and adm.in_flight == 0
        work.reserve("a").release()

    asyncio.run(main())


def background(per_lm: int = 2, lms: int = 1, quota=Tenant) -> BackgroundWork:
    """Background work without an LM pool: only its places are taken and given back."""
    return BackgroundWork(lambda: SimpleNamespace(instances={}), per_lm=per_lm, timeout_s=60.0,
                          generating_lms=lambda: lms, quota=quota)


def keyed(tmp_path, *lines: dict) -> Tenants:
    path = tmp_path / "keys.jsonl"
    path.write_text("".join(json.dumps({"key": f"sk-{line['tenant']}", **line}) + "\n" for line in lines))
    return Tenants(keys_file=str(path))


def refusal(work: BackgroundWork, tenant: str) -> AdmissionRefused:
    with pytest.raises(AdmissionRefused) as e:
        work.reserve(tenant)
    assert e.value.status == 429 and e.value.retry_after_s >= 1
    return e.value


def test_with_two_background_places_one_tenants_flood_leaves_the_other_tenant_a_place(tmp_path):
    """Neither sets max_background: each may hold its share of the 2 places (1), so alice's second is refused
    while bob's first is taken; no refusal counts what the others, or the deployment, hold."""
    work = background(per_lm=2, quota=keyed(tmp_path, {"tenant": "alice"}, {"tenant": "bob"},
                                            {"tenant": "carol"}).quota)
    alice = work.reserve("alice")
    flood = refusal(work, "alice")
    assert "tenant alice" in flood.message and "share" in flood.message
    bob = work.reserve("bob")
    again = refusal(work, "bob")
    assert "tenant bob" in again.message and "alice" not in again.message
    full = refusal(work, "carol")  # her share is free in principle, but no place is: the deployment's message
    assert "no background place is free" in full.message
    for e in (flood, again, full):
        assert not any(c.isdigit() for c in e.message), e.message
    alice.release()
    work.reserve("carol").release()  # a place freed: hers to take
    bob.release()
    assert work.held_by("alice") == work.held_by("bob") == 0


def test_background_places_are_shared_by_weight_and_a_tenant_alone_in_the_keys_takes_them_all(tmp_path):
    work = background(per_lm=2, lms=2, quota=keyed(tmp_path, {"tenant": "a", "weight": 3}, {"tenant": "b"}).quota)
    places = [work.reserve("a") for _ in range(3)]  # three quarters of 4
    refusal(work, "a")
    places.append(work.reserve("b"))
    refusal(work, "b")
    for place in places:
        place.release()

    alone = background(per_lm=2, quota=keyed(tmp_path, {"tenant": "a"}).quota)
    places = [alone.reserve("a") for _ in range(2)]
    assert "no background place is free" in refusal(alone, "a").message
    open_gateway = background(per_lm=2, quota=Tenants().quota)  # without keys: one tenant, every place
    places += [open_gateway.reserve() for _ in range(2)]
    e = refusal(open_gateway, "anonymous")
    assert "--lm-max-background" in e.message and not any(c.isdigit() for c in e.message)
    for place in places:
        place.release()


def test_max_background_takes_the_place_of_a_tenants_share(tmp_path):
    work = background(per_lm=4, quota=keyed(tmp_path, {"tenant": "a", "max_background": 3}, {"tenant": "b"},
                                            {"tenant": "c", "max_background": 1}).quota)
    places = [work.reserve("a") for _ in range(3)]  # above its share (2 of 4): the operator said so
    assert "max_background" in refusal(work, "a").message
    places.append(work.reserve("c"))
    assert "max_background" in refusal(work, "c").message
    assert "no background place is free" in refusal(work, "b").message
    for place in places:
        place.release()


# --- speech uploads against images_per_minute ---------------------------------------------------------------------


def test_a_speech_upload_is_charged_one_item_at_admission_then_each_window_its_encoder_cut():
    now = [0.0]

    async def main():
        adm = admission(clock=lambda: now[0], a=Tenant("a", images_per_minute=4))
        upload = await adm.admit(True, "a", items=1)
        upload.count_items(3)  # its encoder cut it into three windows
        e = await refused(adm, "a", items=2)  # one item of the minute's four is left
        assert "images_per_minute" in e.message and e.retry_after_s == 15
        upload.count_items(3)  # a retry that cut the same windows: nothing more
        upload.count_items(1)  # nor anything back
        other = await adm.admit(False, "a", items=1)
        upload.count_items(5)  # past empty: charged all the same (it is encoded), repaid as the bucket refills
        assert (await refused(adm, "a", items=1)).retry_after_s == 45
        b = await adm.admit(True, "b", items=1)
        b.count_items(100)  # a tenant without the quota is charged nothing
        for t in (upload, other, b):
            t.release()

    asyncio.run(main())


# --- the body budget ---------------------------------------------------------------------------------------------


def intake(**by_tenant: Tenant) -> Intake:
    # A 64 MiB budget; the largest body 8 * 2 MiB (images 0.5 MiB, audio and video 1 MiB).
    cfg = GatewayConfig(lms="lm:1", max_image_bytes=512 << 10, max_audio_bytes=1 << 20, max_video_bytes=1 << 20,
                        body_memory_mib=64)
    return Intake(cfg, quota=quotas(**by_tenant))


async def flood_of(it: Intake, tenant: str, n: int = 8, size: int = 8 * MIB) -> tuple[list, list[BodyRefused]]:
    """``n`` bodies of ``size`` from ``tenant``: their leases, and the refusals of those that did not fit."""
    leases, refused = [it.lease(tenant) for _ in range(n)], []
    for lease in leases:
        try:
            await lease.grow(size)
        except BodyRefused as e:
            refused.append(e)
    return leases, refused


def test_one_tenant_may_fill_the_whole_body_budget_as_before():
    async def main():
        it = intake()
        leases = [it.lease() for _ in range(4)]
        for lease in leases:
            await lease.grow(16 * MIB)
        one_more = it.lease()
        with pytest.raises(BodyRefused) as e:  # the budget is full: the deployment's 503, not a share's 429
            await one_more.grow(MIB)
        assert e.value.status == 503
        for lease in [*leases, one_more]:
            lease.release()
        assert it.budget.used == 0 and not it.shares.held and not it.shares.leases

    asyncio.run(main())


def test_a_flooding_tenant_holds_at_most_its_share_while_another_is_active_and_the_other_still_gets_in():
    async def main():
        it = intake()
        b = it.lease("b")
        await b.grow(MIB)  # b is active: a's share is half the budget
        flood, refused = await flood_of(it, "a")
        assert all(e.status == 429 and "tenant a" in e.message and "2 tenants" in e.message for e in refused)
        assert len(refused) == 4 and it.shares.held["a"] == 32 * MIB
        more_b = [it.lease("b") for _ in range(3)]  # b's bodies still fit
        for lease in more_b:
            await lease.grow(8 * MIB)
        for lease in [b, *flood, *more_b]:
            lease.release()
        assert it.budget.used == 0 and not it.shares.held and not it.shares.leases

    asyncio.run(main())


def test_a_tenants_body_mib_caps_what_it_holds_but_its_first_body_always_fits():
    async def main():
        it = intake(a=Tenant("a", body_mib=4))
        first = it.lease("a")
        await first.grow(20 * MIB)  # its only body: past its quota, still taken (it must make progress)
        second = it.lease("a")
        with pytest.raises(BodyRefused) as e:
            await second.grow(MIB)
        assert e.value.status == 429 and "body_mib" in e.value.message
        first.release()
        await second.grow(3 * MIB)
        second.hold(8 * MIB)  # an answer's bytes are counted, never refused
        assert it.shares.held["a"] == 11 * MIB
        second.release()
        assert it.budget.used == 0

    asyncio.run(main())


# --- the gRPC readers --------------------------------------------------------------------------------------------


def test_one_connection_takes_at_most_its_share_of_the_grpc_readers_whatever_its_tenant():
    assert GRPC_READERS_PER_CONNECTION < GRPC_READERS
    conn, other_conn = "ipv4:10.0.0.1:5000", "ipv4:10.0.0.1:5001"

    async def main():
        it = intake()
        mine = [await it.reserve_message(peer=conn) for _ in range(GRPC_READERS_PER_CONNECTION)]
        with pytest.raises(BodyRefused) as e:  # one more waits for one of its connection's own, in vain
            await it.reserve_message(peer=conn)
        assert e.value.status == 429 and "connection" in e.value.message
        other = await it.reserve_message(peer=other_conn)  # another connection still gets one
        assert it.grpc_reading == GRPC_READERS_PER_CONNECTION + 1
        # A call that waits for its connection's slot gets it when one of the connection's reads ends.
        waiting = asyncio.create_task(it.reserve_message(peer=conn))
        await settle()
        assert not waiting.done() and it.grpc_reading == GRPC_READERS_PER_CONNECTION + 1  # it holds no reader
        mine[0].release()
        it.done_grpc_reading(peer=conn)
        mine[0] = await asyncio.wait_for(waiting, 5)
        for lease in [*mine, other]:
            lease.release()
        for _ in mine:
            it.done_grpc_reading(peer=conn)
        it.done_grpc_reading(peer=other_conn)
        assert it.grpc_reading == 0 and it.budget.used == 0 and not it._peer_slots

    asyncio.run(main())


def test_a_tenants_call_past_its_share_of_the_grpc_readers_waits_for_one_of_its_own_then_429():
    """A named tenant's burst of calls (each on its own connection) is read in turn, not refused at once: one
    past its share waits up to WAIT_S for one of its own slots (found by bench/hostile.py: a legitimate
    tenant's small calls were refused at 20 calls a second)."""
    from services.gateway.intake import GRPC_READERS_PER_TENANT

    async def main():
        it = intake()
        mine = [await it.reserve_message("a", peer=f"ipv4:10.0.0.2:{i}") for i in range(GRPC_READERS_PER_TENANT)]
        with pytest.raises(BodyRefused) as e:
            await it.reserve_message("a", peer="ipv4:10.0.0.2:99")
        assert e.value.status == 429 and "tenant a" in e.value.message
        waiting = asyncio.create_task(it.reserve_message("a", peer="ipv4:10.0.0.2:98"))
        await settle()
        assert not waiting.done() and it.grpc_reading == GRPC_READERS_PER_TENANT  # it holds no reader
        b = await it.reserve_message("b", peer="ipv4:10.0.0.3:1")  # another tenant is not held up
        mine[0].release()
        it.done_grpc_reading("a", peer="ipv4:10.0.0.2:0")
        third = await asyncio.wait_for(waiting, 5)
        for lease, peer in [(mine[1], "ipv4:10.0.0.2:1"), (third, "ipv4:10.0.0.2:98")]:
            lease.release()
            it.done_grpc_reading("a", peer=peer)
        b.release()
        it.done_grpc_reading("b", peer="ipv4:10.0.0.3:1")
        assert it.grpc_reading == 0 and it.budget.used == 0 and not it._tenant_slots

    asyncio.run(main())


# --- weights ---------------------------------------------------------------------------------------------------


def test_freed_places_go_to_waiting_tenants_by_their_weight():
    """a (weight 3) and b (weight 1) both waiting: of four places that free, a gets three, b one."""
    async def main():
        adm = admission(lm_slots=4, queue=8, a=Tenant("a", weight=3), b=Tenant("b"))
        full = [await adm.admit(False, "x") for _ in range(4)]
        waiters = [await queued(adm, tenant=t) for t in "abababab"]
        for ticket in full:
            ticket.release()
            await settle()
        assert (adm.held_by("a"), adm.held_by("b")) == (3, 1)
        await cancel_all(*[w for w in waiters if not w.done()])
        for w in waiters:
            if w.done() and not w.cancelled():
                w.result().release()
        assert adm.in_flight == 0

    asyncio.run(main())


def test_a_tenants_part_of_the_body_budget_is_its_weights_part():
    async def main():
        it = intake(a=Tenant("a", weight=3))
        b = it.lease("b")
        await b.grow(MIB)  # b (weight 1) is active: a may hold three quarters of the 64 MiB
        flood, refused = await flood_of(it, "a")
        assert all(e.status == 429 and "75%" in e.message for e in refused)
        assert len(refused) == 2 and it.shares.held["a"] == 48 * MIB
        for lease in [b, *flood]:
            lease.release()
        assert it.budget.used == 0 and not it.shares.held

    asyncio.run(main())
