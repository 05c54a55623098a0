"""Gateway admission control (``Admission``: slots per healthy LM and encoder, a FIFO queue per tenant,
429 when it is full, 503 after ``wait_s``, room to the waiting tenant with the fewest in flight) and the orchestrator's placement decision, driven
without servers: instance states and outstanding counts are set by hand."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from services.gateway.admission import Admission, AdmissionRefused, Ticket
from services.gateway.config import GatewayConfig
from services.gateway.instances import InstanceState
from services.gateway.orchestrator import Orchestrator
from services.gateway.state import keys
from services.gateway.state.wiring import store_config
from services.gateway.workers import WorkerSeat

pytestmark = pytest.mark.unit


def make(lm_slots=2, encoder_slots=1, queue=8, wait_s=5.0, lms=1, encoders=1) -> tuple[Admission, dict[str, int]]:
    """An Admission whose healthy instance counts are read from the returned dict (change it to
    admit or eject instances)."""
    healthy = {"lm": lms, "encoder": encoders}
    adm = Admission(lm_slots, encoder_slots, queue, wait_s,
                    healthy_lms=lambda: healthy["lm"], healthy_encoders=lambda: healthy["encoder"])
    return adm, healthy


async def settle() -> None:
    """Lets every ready task run until none is (waiters reach their wait, woken ones return)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def admit_now(adm: Admission, encoder: bool = False) -> Ticket:
    """A ticket that must be granted without waiting."""
    assert not adm._waiting
    return await asyncio.wait_for(adm.admit(encoder), 0.05)


async def queued(adm: Admission, encoder: bool = False, tenant: str = "anonymous") -> asyncio.Task:
    """An admit() that must wait (it is in the queue when this returns)."""
    before = adm.waiting
    task = asyncio.create_task(adm.admit(encoder, tenant))
    await settle()
    assert not task.done() and adm.waiting == before + 1
    return task


async def cancel_all(*tasks: asyncio.Task) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- tenants: each its own queue, room to the one with the fewest in flight ------------------------------------------


def test_a_tenants_flood_fills_only_its_own_queue_and_freed_room_goes_to_the_other_tenant_first():
    async def main():
        adm, _ = make(lm_slots=2, queue=3)
        held = [await asyncio.wait_for(adm.admit(False, "flood"), 0.05) for _ in range(2)]
        flood = [await queued(adm, tenant="flood") for _ in range(3)]
        with pytest.raises(AdmissionRefused) as e:  # the flood's own queue is full: 429 for it ...
            await adm.admit(False, "flood")
        assert e.value.status == 429 and "tenant flood" in e.value.message
        other = await queued(adm, tenant="steady")  # ... while the other tenant still queues
        held[0].release()
        await settle()
        # The freed place goes to the tenant with none in flight, not to the flood's older waiter.
        assert other.done() and (await other).tenant == "steady" and not any(t.done() for t in flood)
        assert adm.held_by("flood") == 1 and adm.held_by("steady") == 1
        held[1].release()
        await settle()
        assert flood[0].done() and not flood[1].done()  # then the flood's, in its own order
        (await flood[0]).release()
        (await other).release()
        await settle()
        assert flood[1].done() and flood[2].done()
        for t in flood[1:]:
            (await t).release()
        assert adm.in_flight == 0 and adm.waiting == 0 and not adm._held

    asyncio.run(main())


# --- capacity and the FIFO queue -----------------------------------------------------------------------------------


def test_admits_up_to_lm_slots_times_healthy_lms_then_waits_until_a_release():
    async def go():
        adm, _ = make(lm_slots=2, lms=2)
        assert adm.enabled and adm.capacity()[0] == 4
        tickets = [await admit_now(adm) for _ in range(4)]
        assert adm.in_flight == 4
        waiter = await queued(adm)
        assert adm.in_flight == 4  # a waiter holds nothing
        tickets[0].release()
        await settle()
        assert waiter.done() and not adm._waiting
        tickets.append(waiter.result())
        assert adm.in_flight == 4 and not tickets[-1].released
        for t in tickets:
            t.release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


def test_waiters_are_admitted_in_arrival_order():
    async def go():
        adm, _ = make(lm_slots=1)
        first = await admit_now(adm)
        a, b, c = [await queued(adm) for _ in range(3)]
        first.release()
        await settle()
        assert a.done() and not b.done() and not c.done()
        a.result().release()
        await settle()
        assert b.done() and not c.done()
        b.result().release()
        await settle()
        assert c.done() and not adm._waiting
        c.result().release()
        assert adm.in_flight == 0

    asyncio.run(go())


def test_a_request_waiting_for_an_encoder_is_not_overtaken_by_a_text_request_behind_it():
    async def go():
        adm, _ = make(lm_slots=2, encoder_slots=1)
        enc = await admit_now(adm, encoder=True)
        text = await admit_now(adm)
        enc_waiter = await queued(adm, encoder=True)
        text_waiter = await queued(adm)
        text.release()  # an LM slot is free, the encoder slot is not: the head cannot go
        await settle()
        assert not enc_waiter.done() and not text_waiter.done()
        assert (adm.in_flight, adm.encoding, adm.waiting) == (1, 1, 2)
        # A new text request joins the queue too rather than jumping it.
        late = await queued(adm)
        enc.release()
        await settle()
        assert enc_waiter.done() and text_waiter.done() and not late.done()
        assert enc_waiter.result().encoder and not text_waiter.result().encoder
        assert (adm.in_flight, adm.encoding) == (2, 1)
        enc_waiter.result().release()
        await settle()
        assert late.done()
        text_waiter.result().release()
        late.result().release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


# --- encoder slots -------------------------------------------------------------------------------------------------


def test_a_request_needing_an_encoder_waits_while_encoder_slots_are_used_even_with_lm_slots_free():
    async def go():
        adm, _ = make(lm_slots=8, encoder_slots=1, encoders=2)
        assert adm.capacity() == (8, 2)
        held = [await admit_now(adm, encoder=True) for _ in range(2)]
        assert (adm.in_flight, adm.encoding) == (2, 2)
        waiter = await queued(adm, encoder=True)
        held[0].release()
        await settle()
        assert waiter.done() and (adm.in_flight, adm.encoding) == (2, 2)
        for t in (held[1], waiter.result()):
            t.release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


def test_drop_encoder_returns_the_encoder_slot_wakes_a_waiter_and_release_does_not_free_it_twice():
    async def go():
        adm, _ = make(lm_slots=4, encoder_slots=1)
        local = await admit_now(adm, encoder=True)
        waiter = await queued(adm, encoder=True)
        local.drop_encoder()  # placement chose the LM: the encoder slot goes back now
        assert not local.encoder and not local.released
        await settle()
        assert waiter.done() and (adm.in_flight, adm.encoding) == (2, 1)
        local.drop_encoder()  # a second drop is a no-op
        assert (adm.in_flight, adm.encoding) == (2, 1)
        local.release()
        assert (adm.in_flight, adm.encoding) == (1, 1)  # the LM slot only: the encoder slot is the waiter's
        remote = waiter.result()
        remote.release()
        remote.drop_encoder()  # after release: nothing left to give back
        assert (adm.in_flight, adm.encoding) == (0, 0)
        text = await admit_now(adm)
        text.drop_encoder()  # a text request holds no encoder slot
        text.release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


def test_encoder_slots_zero_means_no_encoder_limit():
    async def go():
        adm, _ = make(lm_slots=3, encoder_slots=0)
        assert adm.capacity() == (3, math.inf)
        tickets = [await admit_now(adm, encoder=True) for _ in range(3)]
        assert adm.encoding == 3
        for t in tickets:
            t.release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


# --- refusals ------------------------------------------------------------------------------------------------------


def test_a_full_queue_is_refused_at_once_with_429():
    async def go():
        adm, _ = make(lm_slots=1, queue=2)
        held = await admit_now(adm)
        waiters = [await queued(adm), await queued(adm)]
        start = time.monotonic()
        with pytest.raises(AdmissionRefused) as e:
            await adm.admit(False)
        assert time.monotonic() - start < 2.5  # at once, not after wait_s (5 s)
        assert e.value.status == 429 and e.value.retry_after_s >= 1 and "capacity" in e.value.message
        assert adm.waiting == 2 and adm.in_flight == 1
        await cancel_all(*waiters)
        held.release()
        assert (adm.in_flight, adm.waiting) == (0, 0)

    asyncio.run(go())


def test_queue_zero_refuses_whatever_does_not_fit_now():
    async def go():
        adm, _ = make(lm_slots=1, queue=0)
        held = await admit_now(adm)
        with pytest.raises(AdmissionRefused) as e:
            await adm.admit(False)
        assert e.value.status == 429
        held.release()
        (await admit_now(adm)).release()
        assert adm.in_flight == 0

    asyncio.run(go())


def test_a_wait_past_wait_s_is_refused_with_503_and_leaves_the_queue():
    async def go():
        adm, _ = make(lm_slots=1, wait_s=0.2)
        held = await admit_now(adm)
        start = time.monotonic()
        with pytest.raises(AdmissionRefused) as e:
            await adm.admit(False)
        waited = time.monotonic() - start
        assert 0.15 <= waited < 3.0  # after wait_s; the upper bound is loose (a busy host is late)
        assert e.value.status == 503 and e.value.retry_after_s >= 1 and "0.2s" in e.value.message
        assert (adm.in_flight, adm.waiting) == (1, 0)
        held.release()
        assert adm.in_flight == 0

    asyncio.run(go())


def test_a_refused_head_of_queue_lets_the_waiter_behind_it_in():
    """The encoder waiter at the head times out; the text waiter behind it, which fits, goes in."""
    async def go():
        # wait_s: the head must still wait when `behind` is checked, however busy the host (with 0.2 s a
        # stall there had the head refused first and `behind` admitted at once).
        adm, _ = make(lm_slots=4, encoder_slots=1, wait_s=2.0)
        enc = await admit_now(adm, encoder=True)
        head = await queued(adm, encoder=True)
        await asyncio.sleep(0.05)
        behind = asyncio.create_task(adm.admit(False))  # fits, but FIFO: waits behind the head
        await settle()
        assert not behind.done()
        with pytest.raises(AdmissionRefused):
            await head
        await settle()
        assert behind.done() and (adm.in_flight, adm.encoding) == (2, 1)
        behind.result().release()
        enc.release()
        assert (adm.in_flight, adm.encoding, adm.waiting) == (0, 0, 0)

    asyncio.run(go())


# --- capacity that changes, cancellation, disabled, idempotence ---------------------------------------------------


def test_a_waiter_is_admitted_when_an_lm_becomes_healthy_without_any_release():
    async def go():
        adm, healthy = make(lm_slots=1, lms=1, wait_s=5.0)
        held = await admit_now(adm)
        waiter = await queued(adm)
        healthy["lm"] = 2  # an LM was admitted: capacity 2, re-checked within a second
        start = time.monotonic()
        ticket = await asyncio.wait_for(waiter, 10)
        assert time.monotonic() - start < 3.0  # at the next re-check (each second), well before wait_s (5 s)
        assert adm.in_flight == 2 and not adm._waiting
        for t in (held, ticket):
            t.release()
        assert adm.in_flight == 0

    asyncio.run(go())


def test_a_waiter_cancelled_while_waiting_takes_nothing_and_leaves_the_queue():
    async def go():
        adm, _ = make(lm_slots=1)
        held = await admit_now(adm)
        gone = await queued(adm)
        nxt = await queued(adm)
        gone.cancel()
        await settle()
        assert gone.cancelled()
        assert adm.in_flight == 1 and adm.waiting == 1 and not nxt.done()
        held.release()
        await settle()
        assert nxt.done() and adm.in_flight == 1  # the next waiter, not the cancelled one, got the place
        nxt.result().release()
        assert (adm.in_flight, adm.waiting) == (0, 0)

    asyncio.run(go())


def test_a_waiter_cancelled_just_before_it_is_admitted_gives_its_place_back():
    async def go():
        adm, _ = make(lm_slots=1, encoder_slots=1)
        held = await admit_now(adm, encoder=True)
        gone = await queued(adm, encoder=True)
        nxt = await queued(adm, encoder=True)
        gone.cancel()  # the client goes away ...
        held.release()  # ... and before its task runs again, the release hands it a ticket
        await settle()
        assert gone.cancelled()
        assert nxt.done() and (adm.in_flight, adm.encoding) == (1, 1)  # gone's ticket went on to `nxt`
        nxt.result().release()
        assert (adm.in_flight, adm.encoding, adm.waiting) == (0, 0, 0)

    asyncio.run(go())


def test_a_waiter_cancelled_just_after_it_is_admitted_leaks_no_place():
    """Released, then cancelled in the same tick. Python 3.11's ``asyncio.wait_for`` may swallow
    that cancel and return the ticket (the caller then holds it and must release it); either way
    every place taken is held by someone who will give it back."""
    async def go():
        adm, _ = make(lm_slots=1, encoder_slots=1)
        held = await admit_now(adm, encoder=True)
        gone = await queued(adm, encoder=True)
        nxt = await queued(adm, encoder=True)
        held.release()
        gone.cancel()
        await settle()
        if not gone.cancelled():  # the cancel was swallowed: `gone` holds the place
            assert not nxt.done() and adm.in_flight == 1
            gone.result().release()
            await settle()
        assert nxt.done() and (adm.in_flight, adm.encoding) == (1, 1)
        nxt.result().release()
        assert (adm.in_flight, adm.encoding, adm.waiting) == (0, 0, 0)

    asyncio.run(go())


def test_lm_slots_zero_disables_admission():
    async def go():
        adm, _ = make(lm_slots=0, encoder_slots=1, queue=0, wait_s=0.1)
        assert not adm.enabled and adm.capacity()[0] == math.inf
        tickets = [await admit_now(adm, encoder=bool(i % 2)) for i in range(50)]
        assert not adm._waiting
        for t in tickets:
            t.release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


def test_release_is_idempotent():
    async def go():
        adm, _ = make(lm_slots=1, encoder_slots=1)
        t = await admit_now(adm, encoder=True)
        t.release()
        t.release()
        assert t.released and (adm.in_flight, adm.encoding) == (0, 0)
        # The place freed once is free once: one more fits, then the next waits.
        again = await admit_now(adm, encoder=True)
        waiter = await queued(adm)
        t.release()
        await settle()
        assert not waiter.done() and adm.in_flight == 1
        again.release()
        await settle()
        waiter.result().release()
        assert (adm.in_flight, adm.encoding) == (0, 0)

    asyncio.run(go())


# --- Orchestrator: placement and what admission asks of it ---------------------------------------------------------

LMS = "127.0.0.1:1,127.0.0.1:3"
ENCODERS = "127.0.0.1:2,127.0.0.1:4"


def set_pool(pool, spec: list[int | None]) -> None:
    """Each instance in address order: its outstanding count when admitted, None when not admitted."""
    for inst, n in zip(pool.instances.values(), spec, strict=True):
        inst.state = InstanceState.PENDING if n is None else InstanceState.ADMITTED
        inst.outstanding = n or 0


def with_orchestrator(check, **cfg) -> None:
    """Runs ``check(orch)`` on an orchestrator that is never started (no health checks, no calls)."""
    async def go():
        orch = Orchestrator(GatewayConfig(**{"lms": LMS, "encoders": ENCODERS, **cfg}))
        try:
            check(orch)
        finally:
            await orch.close()

    asyncio.run(go())


NONE_OUT = {"encoder": set(), "lm": set()}


@pytest.mark.parametrize("lms, encoders, excluded, expected", [
    ([0, 0], [0, 0], NONE_OUT, ("encoder", "auto")),
    ([0, 5], [1, 2], NONE_OUT, ("local", "lm idle, encoders busy")),
    ([5, 0], [1, 1], NONE_OUT, ("local", "lm idle, encoders busy")),
    ([0, 0], [1, 0], NONE_OUT, ("encoder", "auto")),  # an encoder is idle
    ([1, 2], [1, 1], NONE_OUT, ("encoder", "auto")),  # no LM is idle
    ([None, 2], [1, 1], NONE_OUT, ("encoder", "auto")),  # the idle LM is not admitted
    ([0, 0], [1, None], NONE_OUT, ("local", "lm idle, encoders busy")),  # the idle encoder is not admitted
    ([0, 0], [1, 0], {"encoder": {"127.0.0.1:4"}, "lm": set()}, ("local", "lm idle, encoders busy")),
    ([0, 3], [1, 1], {"encoder": set(), "lm": {"127.0.0.1:1"}}, ("encoder", "auto")),  # idle LM failed
    ([0, 0], [None, None], NONE_OUT, ("encoder", "no healthy encoder")),
    ([0, 0], [0, 1], {"encoder": {"127.0.0.1:2", "127.0.0.1:4"}, "lm": set()}, ("encoder", "no healthy encoder")),
    ([None, None], [1, 1], NONE_OUT, ("encoder", "auto")),  # no healthy LM: never local
])
def test_auto_placement_encodes_on_the_lm_only_when_an_lm_is_idle_and_every_encoder_busy(lms, encoders, excluded,
                                                                                           expected):
    def check(orch):
        set_pool(orch.lms, lms)
        set_pool(orch.encoders, encoders)
        assert orch.fleet.placement({k: set(v) for k, v in excluded.items()}) == expected
        assert orch.encodes_remotely(1) and not orch.encodes_remotely(0)

    with_orchestrator(check, placement="auto", placement_busy_encodes=1)


def test_by_default_an_encoder_is_busy_with_one_encode_queued_behind_the_running_one():
    def check(orch):
        set_pool(orch.lms, [0, 0])
        set_pool(orch.encoders, [1, 1])  # one encode each: running, nothing queued
        assert orch.fleet.placement(dict(NONE_OUT)) == ("encoder", "auto")
        set_pool(orch.encoders, [2, 3])
        assert orch.fleet.placement(dict(NONE_OUT)) == ("local", "lm idle, encoders busy")

    with_orchestrator(check, placement="auto")


@pytest.mark.parametrize("placement", ["encoder", "local"])
def test_configured_placement_is_kept_whatever_the_load(placement):
    def check(orch):
        for lms, encoders in [([0, 0], [1, 1]), ([3, 3], [0, 0]), ([0, 0], [None, None])]:
            set_pool(orch.lms, lms)
            set_pool(orch.encoders, encoders)
            assert orch.fleet.placement({"encoder": set(), "lm": set()}) == (placement, "configured")
        assert orch.encodes_remotely(2) is (placement == "encoder")
        assert not orch.encodes_remotely(0)

    with_orchestrator(check, placement=placement)


def test_without_encoders_images_are_encoded_on_the_lm_and_hold_no_encoder_slot():
    def check(orch):
        set_pool(orch.lms, [0, 0])
        assert orch.encoders is None
        assert orch.fleet.placement({"encoder": set(), "lm": set()}) == ("local", "no encoders")
        assert not orch.encodes_remotely(3)
        assert orch.admission.capacity() == (2 * 5, math.inf)  # encoder slots off without encoders

    with_orchestrator(check, encoders="", lm_max_outstanding=5)


def test_orchestrator_admission_capacity_follows_healthy_instances():
    def check(orch):
        adm = orch.admission
        assert (adm.lm_slots, adm.encoder_slots, adm.queue, adm.wait_s) == (3, 2, 7, 1.5)
        set_pool(orch.lms, [None, None])
        set_pool(orch.encoders, [None, None])
        assert adm.capacity() == (3, 2)  # none healthy yet: as if one were (requests wait, not 503 at once)
        set_pool(orch.lms, [0, 0])
        set_pool(orch.encoders, [0, None])
        assert adm.capacity() == (6, 2)
        set_pool(orch.encoders, [0, 0])
        assert adm.capacity() == (6, 4)

    with_orchestrator(check, lm_max_outstanding=3, encoder_max_outstanding=2, admission_queue=7,
                      admission_wait_s=1.5)


# --- where the places are counted ----------------------------------------------------------------------------------


def test_an_admitted_requests_places_are_one_lease_on_the_state_and_drop_encoder_swaps_it_for_one_without():
    async def go():
        adm, _ = make(lm_slots=2, encoder_slots=1)
        names = [keys.LM, keys.ENCODER, keys.in_flight("anonymous")]
        ticket = await admit_now(adm, encoder=True)
        assert await adm.state.counts(names) == dict.fromkeys(names, 1)
        ticket.drop_encoder()
        assert await adm.state.counts(names) == {keys.LM: 1, keys.ENCODER: 0, keys.in_flight("anonymous"): 1}
        ticket.release()
        assert await adm.state.counts(names) == dict.fromkeys(names, 0)

    asyncio.run(go())


def test_each_gateway_process_is_counted_among_replicas_times_workers_and_without_a_store_none_is_opened():
    seat = WorkerSeat(supervisor=1, index=1, count=2, store="unix:///tmp/private.sock", store_password_file="/pw")
    shared = GatewayConfig(lms="lm:1", state_store="redis://store:6379", state_store_replicas=3, state_store_replica=2,
                           state_store_lease_s=9.0, state_store_unreachable="closed")
    sc = store_config(shared, seat)  # --state-store wins over the supervisor's private store
    assert (sc.url, sc.processes, sc.index, sc.lease_s, sc.heartbeat_s, sc.unreachable) == \
        ("redis://store:6379", 6, 5, 9.0, 3.0, "closed")
    private = store_config(GatewayConfig(lms="lm:1"), seat)
    assert (private.url, private.password_file, private.processes, private.index) == \
        ("unix:///tmp/private.sock", "/pw", 2, 1)
    assert store_config(GatewayConfig(lms="lm:1")) is None
    with pytest.raises(ValueError, match="state_store_replica"):
        GatewayConfig(lms="lm:1", state_store="redis://store:6379", state_store_replicas=2, state_store_replica=2)
    with pytest.raises(ValueError, match="unreachable"):
        GatewayConfig(lms="lm:1", state_store_unreachable="open")
