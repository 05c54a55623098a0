"""Admission control: past capacity, a request waits its turn or is refused at once,
with a status the client can act on; it never times out half-way through.

The deployment takes at most ``--lm-max-outstanding`` admitted requests at once per
healthy LM, and ``--encoder-max-outstanding`` per healthy encoder for requests that
encode on one (``capacity``). These places are pooled, not tied to an instance (admission
comes before routing); once routing has picked the LM, the request also holds a place on
that LM (``services.gateway.lm_places``), so no LM holds more than its number either. A
request that finds no room waits in its tenant's
FIFO queue (at most ``--admission-queue`` requests per tenant, each at most
``--admission-wait-s``); a full queue is 429 (that tenant is over its share: the
others' queues are untouched), a wait that runs out is 503 (the deployment as a
whole is full), both with ``Retry-After``. Room that frees goes to the waiting
tenant with the fewest requests in flight per unit of its ``weight`` (keys file;
1 by default; ties: the one waiting longest), so one
tenant's flood fills its own queue and takes turns with the others, never their
places. With one tenant (a gateway without keys) this is one FIFO queue.

A tenant's quotas from the keys file (``quota(tenant)``, read at every decision so
a reload holds at once) narrow this further, each answered 429 with ``Retry-After``
(that tenant is over its quota; 503 stays for the deployment as a whole): at its
``max_in_flight`` a request is refused at once (and its waiters are passed over
until one of its own ends), its queue holds ``max_queue`` (else
``--admission-queue``), and ``ItemRate`` admits at most ``images_per_minute``
media items a minute (a request's items are taken when it arrives and given back
if it is not admitted). Items are charged for what a request delivered, never for
what it claims: a speech upload is one item when it arrives, and once its encoder
has cut it into windows, each window beyond the first is charged too
(``Ticket.count_items``; never refused then, so the bucket may go below empty and
the tenant's next media wait until it has refilled). Refusals name the tenant's own
limit and never count what other tenants, or the deployment, hold.
An admitted request holds its place until its answer ends (``Ticket.release``, also
on failure or a client that goes away), so what the LMs and encoders have in
flight stays bounded and every admitted request is served within the limits the
engines were sized for. ``--lm-max-outstanding 0`` turns admission off.

Where the places are counted (``services.gateway.state``): an admitted request's places (an LM place,
an encoder place when it encodes on an encoder, one of its tenant's ``max_in_flight``) are one
``acquire`` on the orchestrator's ``SharedState``, under the names ``services.gateway.state.keys``
gives them, held by its ``Ticket`` as one lease; its media items are taken from the state's rate. With
one gateway process that is a ``LocalState``: every decision is made at once, in memory, as above.
With several (``--workers``, replicas over ``--state-store``) it is the store they share, so each limit
and quota holds for the whole front door; the queues stay in each process (its own waiters, in the
order above among them), and a waiter is tried again when a place frees in any process (the state's
word of it) and at least every ``POLL_S``. The places of a process that dies go back within the
store's lease; a store that does not answer leaves each process its part of every limit
(``services.gateway.state.redis_state``).

Owner: the orchestrator creates one ``Admission`` (and closes it); the REST and gRPC front ends
call ``admit`` before any image is fetched and release the ticket when the
response is done. Everything runs on the gateway's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from services.gateway.state import keys
from services.gateway.state.base import Lease, SharedState
from services.gateway.state.bucket import Buckets
from services.gateway.state.local import LocalState
from services.gateway.tickets import ANONYMOUS, NO_QUOTA, AdmissionRefused, Quota, Ticket

ADMISSIONS = Counter("epd_gateway_admission_total", "Admission decisions",
                     ["outcome"])  # admitted | queued | refused_full | refused_wait | refused_quota
# With --workers: the whole gateway's (services.gateway.metrics).
WAITING = Gauge("epd_gateway_admission_waiting", "Requests waiting for admission", multiprocess_mode="livesum")
ADMITTED = Gauge("epd_gateway_admission_in_flight", "Admitted requests in flight, by what they hold", ["holds"],
                 multiprocess_mode="livesum")


POLL_S = 1.0
"""The longest a waiter waits without word of a freed place before it is tried again (capacity also grows
when an instance is admitted, which no release announces)."""


ItemRate = Buckets
"""Media items admitted per minute, per tenant: a token bucket that holds ``per_minute`` items and refills
at ``per_minute`` a minute (``services.gateway.state.bucket``; a ``LocalState``'s rates, and a store's
while it is unreachable)."""


@dataclass(eq=False)
class _Waiter:
    encoder: bool
    tenant: str
    seq: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _bound(capacity: float) -> int | None:
    """A capacity as a state's limit (None: no limit)."""
    return None if capacity == math.inf else int(capacity)


class Admission:
    def __init__(self, lm_slots: int, encoder_slots: int, queue: int, wait_s: float,
                 healthy_lms: Callable[[], int], healthy_encoders: Callable[[], int],
                 quota: Callable[[str], Quota] = lambda tenant: NO_QUOTA,
                 clock: Callable[[], float] = time.monotonic, state: SharedState | None = None) -> None:
        """``lm_slots``/``encoder_slots``: admitted requests per healthy instance (0: no limit);
        ``healthy_*``: how many instances are admitted now (read at every decision); ``quota``: a
        tenant's quotas (``Tenants.quota``), read at every decision; ``state``: where places and rates are
        counted (default: a ``LocalState`` of this process, its rates on ``clock``; a shared one is started
        and closed by whoever made it)."""
        self.lm_slots, self.encoder_slots = lm_slots, encoder_slots
        self.queue, self.wait_s = queue, wait_s
        self._healthy_lms, self._healthy_encoders = healthy_lms, healthy_encoders
        self.in_flight = 0
        self.encoding = 0
        self._held: collections.Counter[str] = collections.Counter()  # in flight from this process, per tenant
        self._waiting: dict[str, collections.deque[_Waiter]] = {}  # per tenant, FIFO; no empty queues
        self._seq = itertools.count()
        self._served: dict[str, int] = {}  # per tenant with requests in flight or waiting: its last admission
        self.quota = quota
        self.state = state if state is not None else LocalState(clock)
        # In memory: decided at once, in the caller's step. Else waiters are admitted by ``_run_pump``.
        self._local = self.state if isinstance(self.state, LocalState) else None
        self._pump: asyncio.Task | None = None
        self._kick = asyncio.Event()
        self._swaps: set[asyncio.Task] = set()
        if self._local is None:
            self.state.on_freed(lambda freed: self._wake())

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def held_by(self, tenant: str) -> int:
        """Admitted requests of ``tenant`` in flight from this process."""
        return self._held[tenant]

    @property
    def enabled(self) -> bool:
        return self.lm_slots > 0

    def capacity(self) -> tuple[float, float]:
        """(LM, encoder) requests that may be in flight now."""
        lms = self.lm_slots * max(1, self._healthy_lms()) if self.lm_slots else math.inf
        encoders = (self.encoder_slots * max(1, self._healthy_encoders())) if self.encoder_slots else math.inf
        return lms, encoders

    def _limits(self, encoder: bool, tenant: str, quota: Quota) -> dict[str, int | None]:
        """What one admitted request takes, each with its limit now (admission off: only its tenant's)."""
        lms, encoders = self.capacity() if self.enabled else (math.inf, math.inf)
        limits = {keys.LM: _bound(lms)}
        if encoder:
            limits[keys.ENCODER] = _bound(encoders)
        limits[keys.in_flight(tenant)] = quota.max_in_flight
        return limits

    def _capped(self, tenant: str, quota: Quota | None = None) -> bool:
        """Whether ``tenant`` has its ``max_in_flight`` requests in flight from this process alone."""
        cap = (quota or self.quota(tenant)).max_in_flight
        return cap is not None and self._held[tenant] >= cap

    async def _over_cap(self, tenant: str, quota: Quota) -> int | None:
        """What ``tenant`` has in flight across the front door when that is its ``max_in_flight`` or more,
        else None."""
        cap = quota.max_in_flight
        if cap is None:
            return None
        held = self._held[tenant]
        if held < cap:
            key = keys.in_flight(tenant)
            held = (await self.state.counts([key]))[key]
        return held if held >= cap else None

    @staticmethod
    def _quota_refused(tenant: str, held: int) -> AdmissionRefused:
        ADMISSIONS.labels("refused_quota").inc()
        return AdmissionRefused(429, f"tenant {tenant} has {held} requests in flight, its quota (max_in_flight); "
                                     "retry later", 1)

    async def admit(self, encoder: bool, tenant: str = ANONYMOUS, items: int = 0) -> Ticket:
        """A ticket for a request of ``tenant`` (``encoder``: it will encode on an encoder; ``items``: the
        media items it carries), at once or after waiting its turn. Raises AdmissionRefused."""
        quota = self.quota(tenant)
        if self._capped(tenant, quota):
            raise self._quota_refused(tenant, self._held[tenant])
        rate = quota.images_per_minute if items else None
        if rate is not None:
            wait = await self.state.take(keys.images(tenant), items, rate)
            if wait:
                ADMISSIONS.labels("refused_quota").inc()
                raise AdmissionRefused(429, f"tenant {tenant} may have {rate} media items a minute admitted, its "
                                            f"quota (images_per_minute); this request has {items}; retry later",
                                       60 if wait == math.inf else max(1, math.ceil(wait)))
        try:
            ticket = await self._admit(encoder, tenant, quota)
            ticket.items = items
            return ticket
        except BaseException:
            if rate is not None:
                self.state.give_back(keys.images(tenant), items, rate)
            raise

    async def _admit(self, encoder: bool, tenant: str, quota: Quota) -> Ticket:
        if not self._waiting or not self.enabled:
            lease = await self.state.acquire(self._limits(encoder, tenant, quota))
            if lease is not None:
                if self.enabled:
                    ADMISSIONS.labels("admitted").inc()
                return self._ticket(encoder, tenant, lease)
        held = await self._over_cap(tenant, quota)
        if held is not None or not self.enabled:  # admission off: only the tenant's quota refuses
            raise self._quota_refused(tenant, quota.max_in_flight if held is None else held)
        return await self._wait(encoder, tenant, quota)

    async def _wait(self, encoder: bool, tenant: str, quota: Quota) -> Ticket:
        queue = self._waiting.get(tenant, ())
        limit, flag = (self.queue, "--admission-queue") if quota.max_queue is None else (quota.max_queue, "max_queue")
        if len(queue) >= limit:
            ADMISSIONS.labels("refused_full").inc()
            # No counts: without keys every client is one tenant, and its counts would be everyone's.
            whose = "" if tenant == ANONYMOUS else f" for tenant {tenant}"
            raise AdmissionRefused(429, f"the gateway is at capacity{whose} and the admission queue is full "
                                        f"({flag}); retry later", 1)
        waiter = _Waiter(encoder, tenant, next(self._seq))
        self._waiting.setdefault(tenant, collections.deque()).append(waiter)
        WAITING.set(self.waiting)
        ADMISSIONS.labels("queued").inc()
        self._wake()  # room another tenant's head could not use may be this one's
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        try:
            while True:
                # Re-checked every second: capacity grows when an instance is admitted. (asyncio.wait,
                # not wait_for: a cancel that meets an admission in the same tick is not lost.)
                await asyncio.wait([waiter.future], timeout=max(0.0, min(POLL_S, deadline - loop.time())))
                if waiter.future.done():
                    return waiter.future.result()
                if loop.time() >= deadline:
                    break
                self._wake()
            ADMISSIONS.labels("refused_wait").inc()
            raise AdmissionRefused(503, f"the gateway is at capacity: not admitted within {self.wait_s:g}s; "
                                        "retry later", max(1, int(self.wait_s)))
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()
            raise
        finally:
            if self._unqueue(waiter):
                self._wake()

    def _unqueue(self, waiter: _Waiter) -> bool:
        queue = self._waiting.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.tenant]
        WAITING.set(self.waiting)
        return True

    def _ticket(self, encoder: bool, tenant: str, lease: Lease) -> Ticket:
        self.in_flight += 1
        self.encoding += encoder
        self._held[tenant] += 1
        self._served[tenant] = next(self._seq)
        self._gauges()
        return Ticket(self, encoder, tenant, lease=lease)

    def _release(self, ticket: Ticket) -> None:
        self.in_flight -= 1
        self.encoding -= ticket.encoder
        self._held[ticket.tenant] -= 1
        if self._held[ticket.tenant] <= 0:
            del self._held[ticket.tenant]
            if ticket.tenant not in self._waiting:
                self._served.pop(ticket.tenant, None)  # bounded by the tenants in flight or waiting
        self._gauges()
        if ticket.lease is not None:
            self.state.release(ticket.lease)  # a shared state's word of it wakes the waiters
        if self._local is not None:
            self._wake()

    def _charge(self, tenant: str, items: int) -> None:
        """``Ticket.count_items``'s charge, against the tenant's ``images_per_minute`` as it is now."""
        rate = self.quota(tenant).images_per_minute
        if rate is not None:
            self.state.charge(keys.images(tenant), items, rate)

    def _release_encoder(self, ticket: Ticket) -> None:
        """The ticket's lease is swapped for one without the encoder place: the new one taken (``force``:
        it holds these places already) before the old goes, so no process ever counts fewer places than
        are held."""
        self.encoding -= 1
        self._gauges()
        counted = {keys.LM: None, keys.in_flight(ticket.tenant): None}
        if self._local is not None:
            old, ticket.lease = ticket.lease, self._local.try_acquire(counted, force=True)
            if old is not None:
                self._local.release(old)
            self._wake()
            return
        task = asyncio.get_running_loop().create_task(self._swap(ticket, counted), name="admission swap")
        self._swaps.add(task)
        task.add_done_callback(self._swaps.discard)

    async def _swap(self, ticket: Ticket, counted: dict[str, None]) -> None:
        old = ticket.lease
        new = await self.state.acquire(counted, force=True)
        if new is None:
            return  # the encoder place stays counted until the ticket's release: never fewer than held
        if ticket.released or ticket.lease is not old:  # released meanwhile, with its old lease
            self.state.release(new)
            return
        ticket.lease = new
        if old is not None:
            self.state.release(old)

    def _next(self, passed: frozenset[str] | set[str] = frozenset()) -> _Waiter | None:
        """The head of the queue of the waiting tenant with the fewest requests in flight per unit of its
        ``weight`` (ties: the tenant admitted least recently, so tenants take turns; then the head that has
        waited longest). A tenant at its ``max_in_flight`` (from this process, or ``passed``: across the front
        door) is passed over: its waiters wait for one of its own requests to end."""
        heads = (q[0] for t, q in self._waiting.items() if t not in passed and not self._capped(t))
        return min(heads, key=lambda w: (self._held[w.tenant] / self.quota(w.tenant).share,
                                         self._served.get(w.tenant, -1), w.seq), default=None)

    def _wake(self) -> None:
        """Admits waiters while the next one (``_next``) gets its places; it is never passed over (a request
        that needs an encoder slot is not overtaken by text requests behind it). In memory at once; with a
        shared state by ``_run_pump``, which this starts or nudges."""
        if self._local is None:
            self._kick.set()
            if self._waiting and (self._pump is None or self._pump.done()):
                self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name="admission waiters")
            return
        while (waiter := self._next()) is not None:
            lease = self._local.try_acquire(self._limits(waiter.encoder, waiter.tenant, self.quota(waiter.tenant)))
            if lease is None:
                return
            self._unqueue(waiter)
            if waiter.future.done():
                self._local.release(lease)
                continue
            ADMISSIONS.labels("admitted").inc()
            waiter.future.set_result(self._ticket(waiter.encoder, waiter.tenant, lease))

    async def _run_pump(self) -> None:
        """While this process has waiters (shared state): admits them (``_pump_once``), then waits for word of a
        freed place, a new waiter, or ``POLL_S``."""
        while self._waiting:
            self._kick.clear()
            await self._pump_once()
            if self._waiting and not self._kick.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), POLL_S)

    async def _pump_once(self) -> None:
        """``_wake`` on a shared state: each try is a round trip to the store, so a waiter may leave (its wait
        ran out, its client went away) meanwhile; a place taken for it then goes back at once."""
        passed: set[str] = set()  # tenants found at their max_in_flight across the front door
        while (waiter := self._next(passed)) is not None:
            quota = self.quota(waiter.tenant)
            lease = await self.state.acquire(self._limits(waiter.encoder, waiter.tenant, quota))
            if lease is None:
                if await self._over_cap(waiter.tenant, quota) is None:
                    return  # no room for the head, and nobody overtakes it
                passed.add(waiter.tenant)
                continue
            if not self._unqueue(waiter) or waiter.future.done():
                self.state.release(lease)
                continue
            ADMISSIONS.labels("admitted").inc()
            waiter.future.set_result(self._ticket(waiter.encoder, waiter.tenant, lease))

    async def close(self) -> None:
        """Stops the waiters' pump and the lease swaps in flight (the tickets keep what they hold, and give it
        back on release)."""
        tasks = [t for t in (self._pump, *self._swaps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _gauges(self) -> None:
        ADMITTED.labels("lm").set(self.in_flight)
        ADMITTED.labels("encoder").set(self.encoding)
