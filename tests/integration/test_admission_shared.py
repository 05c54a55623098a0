"""Admission and background places held for the whole front door: two gateway processes, each its own
``Admission`` (and ``BackgroundWork``) over its own ``RedisState`` client of one real redis-server
(``redis_fixture``), as two workers or two replicas are. A tenant's ``max_in_flight``, an LM limit under a
burst, a waiter woken by a release in the other process, the places of a process killed with ``kill -9``,
and a frozen store (each process on its part, then the whole limit again)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.gateway.admission import Admission, AdmissionRefused, Ticket
from services.gateway.background import BackgroundWork
from services.gateway.state import keys
from services.gateway.tenants import Tenant
from tests.integration.redis_fixture import MsClock, holding_child, namespace, processes, run, until

pytestmark = pytest.mark.integration

SURE = {"call_timeout_s": 10.0}
"""A call timeout no busy machine reaches, so no process falls back where the test is about the shared counts."""
ALICE = Tenant("alice", max_in_flight=1, images_per_minute=4)


def gateway(state, lm_slots: int = 8, queue: int = 8, wait_s: float = 60.0, encoder_slots: int = 0,
            lms: int = 1) -> Admission:
    """One gateway process's admission over ``state``, with ``lms`` healthy LMs and one healthy encoder."""
    return Admission(lm_slots, encoder_slots, queue, wait_s, healthy_lms=lambda: lms, healthy_encoders=lambda: 1,
                     quota=lambda name: ALICE if name == "alice" else Tenant(name), state=state)


async def refused(adm: Admission, tenant: str = "anonymous", items: int = 0) -> AdmissionRefused:
    with pytest.raises(AdmissionRefused) as e:
        await adm.admit(False, tenant, items=items)
    return e.value


async def queued(adm: Admission, tenant: str = "anonymous") -> asyncio.Task:
    """An admit() that waits in ``adm``'s queue when this returns."""
    before = adm.waiting
    task = asyncio.create_task(adm.admit(False, tenant))
    await until(lambda: adm.waiting == before + 1 or task.done())
    assert not task.done()
    return task


# --- places and quotas across processes ------------------------------------------------------------------------------


def test_a_tenant_with_max_in_flight_one_gets_one_place_across_both_processes(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            one, two = gateway(a), gateway(b)
            held = await one.admit(False, "alice")
            e = await refused(two, "alice")
            assert e.status == 429 and "max_in_flight" in e.message
            (await two.admit(False, "bob")).release()  # the deployment has room: only alice is at her quota
            held.release()
            await a.flush()  # the release has reached the store
            (await two.admit(False, "alice")).release()
    run(body)


def test_a_tenants_images_per_minute_is_one_bucket_across_both_processes(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            one, two = gateway(a), gateway(b)
            (await one.admit(False, "alice", items=3)).release()
            await a.flush()
            e = await refused(two, "alice", items=2)  # one item of her minute's four is left
            assert e.status == 429 and "images_per_minute" in e.message
            ticket = await two.admit(False, "alice", items=1)
            ticket.count_items(3)  # its windows, charged past empty in the store
            await b.flush()
            assert (await refused(one, "alice", items=1)).retry_after_s > 15  # two items of debt to repay first
            ticket.release()
    run(body)


def test_an_lm_limit_of_two_holds_across_both_processes_under_a_burst(store):
    async def body():
        async with processes(store, 2, **SURE) as states:
            gateways = [gateway(state, lm_slots=2, queue=32) for state in states]
            running, most, done = [0], [0], []

            async def request(adm: Admission) -> None:
                ticket = await adm.admit(False)
                running[0] += 1
                most[0] = max(most[0], running[0])
                await asyncio.sleep(0.01)
                running[0] -= 1
                ticket.release()
                done.append(ticket)

            await asyncio.gather(*(request(adm) for adm in gateways for _ in range(12)))
            assert len(done) == 24 and most[0] <= 2
            for state in states:
                await state.flush()
            assert await states[0].counts([keys.LM]) == {keys.LM: 0}
    run(body)


def test_a_waiter_in_one_process_is_admitted_when_a_place_frees_in_the_other(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            one, two = gateway(a, lm_slots=1), gateway(b, lm_slots=1)
            held = await one.admit(False)
            waiter = await queued(two)
            held.release()
            ticket = await asyncio.wait_for(waiter, 30)  # a hang guard: the store's word comes at once
            assert isinstance(ticket, Ticket) and two.waiting == 0
            ticket.release()
    run(body)


def test_a_waiter_whose_tenant_reached_its_quota_elsewhere_is_passed_over_for_another_tenants(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            # one sees two LMs (4 places), two sees one (2): each decides on its own view of the fleet
            one, two = gateway(a, lm_slots=2, lms=2), gateway(b, lm_slots=2)
            fill = [await one.admit(False, "carol"), await one.admit(False, "carol")]  # full, in two's view
            alice_waits, bob_waits = await queued(two, "alice"), await queued(two, "bob")
            alice = await one.admit(False, "alice")  # alice reaches her max_in_flight in the other process
            for ticket in fill:
                ticket.release()
            bob = await asyncio.wait_for(bob_waits, 30)  # alice's waiter is passed over; a hang guard
            assert not alice_waits.done() and two.waiting == 1
            alice.release()  # one of her own ended: her waiter's turn
            alice_again = await asyncio.wait_for(alice_waits, 30)
            for ticket in (bob, alice_again):
                ticket.release()
    run(body)


def test_an_encoder_place_dropped_goes_back_to_the_store_while_the_lm_place_stays(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            one, two = gateway(a, lm_slots=4, encoder_slots=1), gateway(b, lm_slots=4, encoder_slots=1)
            local = await one.admit(True)
            assert await a.counts([keys.LM, keys.ENCODER]) == {keys.LM: 1, keys.ENCODER: 1}
            local.drop_encoder()  # placement chose the LM
            await until(lambda: counts_are(a, {keys.LM: 1, keys.ENCODER: 0}), timeout=30)  # a hang guard
            remote = await two.admit(True)  # the encoder place is the other process's to take
            local.release()
            remote.release()
            for state in (a, b):
                await state.flush()
            assert await b.counts([keys.LM, keys.ENCODER]) == {keys.LM: 0, keys.ENCODER: 0}
    run(body)


async def counts_are(state, expected: dict[str, int]) -> bool:
    return await state.counts(list(expected)) == expected


def test_background_places_hold_across_both_processes(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            one = BackgroundWork(lambda: None, per_lm=1, timeout_s=60.0, generating_lms=lambda: 1, state=a)
            two = BackgroundWork(lambda: None, per_lm=1, timeout_s=60.0, generating_lms=lambda: 1, state=b)
            place = await one.take_place("alice")
            with pytest.raises(AdmissionRefused) as e:
                await two.take_place("bob")
            assert e.value.status == 429 and "--lm-max-background" in e.value.message
            place.release()
            await a.flush()
            (await two.take_place("bob")).release()
    run(body)


# --- a process that dies ---------------------------------------------------------------------------------------------


def test_the_places_of_a_process_that_stopped_renewing_go_to_a_waiter_elsewhere_when_its_lease_runs_out(store):
    async def body():
        clock = MsClock()
        # heartbeats far apart: on the fake clock, nobody renews unless the test says so
        fields = {"clock_ms": clock, "heartbeat_s": 100.0, "lease_s": 300.0, "namespace": namespace(), **SURE}
        async with processes(store, 1, **fields) as (silent,):
            await gateway(silent, lm_slots=1).admit(False)  # held, never released: its process goes silent
            async with processes(store, 1, **fields) as (other,):
                two = gateway(other, lm_slots=1)
                waiter = await queued(two)
                clock.now += 300_000 + 1  # past the silent process's lease
                ticket = await asyncio.wait_for(waiter, 30)  # at its next try (each POLL_S): a hang guard
                ticket.release()
    run(body)


def test_a_process_killed_with_sigkill_while_holding_the_lm_place_gives_it_to_a_waiter_within_its_lease(store):
    ns = namespace()
    child = holding_child(store, ns, keys.LM)  # holds the one LM place (heartbeat 1 s, lease 10 s)

    async def body():
        async with processes(store, 1, namespace=ns, **SURE) as (state,):
            adm = gateway(state, lm_slots=1)
            waiter = await queued(adm)  # the child holds the place, and renews it
            child.send_signal(signal.SIGKILL)
            child.wait()
            ticket = await asyncio.wait_for(waiter, 60)  # within the child's lease (10 s); 60: a hang guard
            ticket.release()
    try:
        run(body)
    finally:
        child.kill()
        child.wait()


# --- the store unreachable ---------------------------------------------------------------------------------------


def test_a_frozen_store_leaves_each_process_its_share_of_the_lm_limit_then_the_whole_limit_again(own_store):
    async def body():
        # a frozen store answers nothing: only the call timeout tells (2 s: short, yet past a busy machine's stalls)
        fields = {"call_timeout_s": 2.0, "heartbeat_s": 0.5, "lease_s": 5.0}
        async with processes(own_store, 2, **fields) as (a, b):
            one, two = gateway(a, lm_slots=4, queue=0), gateway(b, lm_slots=4, queue=0)
            held = [await one.admit(False)]
            os.kill(own_store.pid, signal.SIGSTOP)
            try:
                held.append(await one.admit(False))  # within the call timeout, then on its part: 2 of 4
                assert not a.shared
                assert (await refused(one)).status == 429  # its part is full; no hang, no lost request
                held += [await two.admit(False), await two.admit(False)]
                assert (await refused(two)).status == 429
                held.pop().release()  # a release never fails: the store is told when it answers
            finally:
                os.kill(own_store.pid, signal.SIGCONT)
            await until(lambda: a.shared and b.shared)
            assert await a.counts([keys.LM]) == {keys.LM: 3}  # every place still held, in the store again
            held.append(await two.admit(False))
            assert (await refused(one)).status == 429  # the whole limit again, no more parts
            for ticket in held:
                ticket.release()
    run(body)
