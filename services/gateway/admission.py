"""Admission control: past capacity, a request waits its turn or is refused at once,
with a status the client can act on; it never times out half-way through.

Each healthy LM takes at most ``--lm-max-outstanding`` admitted requests at once,
and each healthy encoder at most ``--encoder-max-outstanding`` admitted requests
that encode on it (``capacity``). A request that finds no room waits in its tenant's
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

Owner: the orchestrator creates one ``Admission``; the REST and gRPC front ends
call ``admit`` before any image is fetched and release the ticket when the
response is done. Everything runs on the gateway's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter, Gauge

ADMISSIONS = Counter("epd_gateway_admission_total", "Admission decisions",
                     ["outcome"])  # admitted | queued | refused_full | refused_wait | refused_quota
WAITING = Gauge("epd_gateway_admission_waiting", "Requests waiting for admission")
ADMITTED = Gauge("epd_gateway_admission_in_flight", "Admitted requests in flight, by what they hold", ["holds"])


class AdmissionRefused(Exception):
    """The request was not admitted: ``status`` 429 (its tenant's queue is full, or the tenant is over a
    quota) or 503 (it waited ``admission_wait_s`` in vain); ``retry_after_s`` goes into ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


ANONYMOUS = "anonymous"  # services.gateway.tenants.ANONYMOUS (this module imports no service module)


class Quota(Protocol):
    """What admission reads of a tenant's quotas (``services.gateway.tenants.Tenant``; None: no limit)."""

    max_in_flight: int | None
    max_queue: int | None
    images_per_minute: int | None

    @property
    def share(self) -> float: ...


@dataclass(frozen=True)
class NoQuota:
    """A tenant without quotas (a gateway without a keys file)."""

    max_in_flight: int | None = None
    max_queue: int | None = None
    images_per_minute: int | None = None
    share: float = 1.0


NO_QUOTA = NoQuota()


class ItemRate:
    """Media items admitted per minute, per tenant: a token bucket that holds ``per_minute`` items and
    refills at ``per_minute`` a minute (so a tenant idle for a minute may send a minute's worth at once).
    ``clock``: seconds, monotonic (tests pass their own). A bucket goes once it is full again, so
    only tenants that sent items within the last minute are kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant: (items left, when)

    def _level(self, tenant: str, per_minute: int) -> float:
        left, at = self._buckets.get(tenant, (per_minute, 0.0))
        return min(float(per_minute), left + (self._clock() - at) * per_minute / 60.0)

    def take(self, tenant: str, items: int, per_minute: int) -> float:
        """Takes ``items`` from ``tenant``'s bucket: 0.0 if they were there, else (nothing taken) the
        seconds until they will be (``math.inf``: more than a minute's worth, never)."""
        if items > per_minute:
            return math.inf
        level = self._level(tenant, per_minute)
        if level < items:
            return (items - level) * 60.0 / per_minute
        self._buckets[tenant] = (level - items, self._clock())
        return 0.0

    def charge(self, tenant: str, items: int, per_minute: int) -> None:
        """Takes ``items`` a request delivered after it was admitted, whatever is left: the bucket may go below
        empty, and the tenant's next items wait until it has refilled past them."""
        self._buckets[tenant] = (self._level(tenant, per_minute) - items, self._clock())

    def give_back(self, tenant: str, items: int, per_minute: int) -> None:
        """Items of a request that was not admitted after all."""
        level = min(float(per_minute), self._level(tenant, per_minute) + items)
        if level >= per_minute:
            self._buckets.pop(tenant, None)
        else:
            self._buckets[tenant] = (level, self._clock())


@dataclass(eq=False)
class Ticket:
    """One admitted request's place: an LM slot, and an encoder slot if it encodes remotely; ``items``: the
    media items charged against its tenant's ``images_per_minute``."""

    admission: Admission
    encoder: bool
    tenant: str = ANONYMOUS
    released: bool = False
    items: int = 0

    def count_items(self, items: int) -> None:
        """The request carries ``items`` media items now: a speech upload, one item at admission, becomes one
        item per window its encoder cut (the orchestrator calls this once an attempt's items have their
        sources). Those beyond what was charged are charged now, never refused (the request is admitted and
        they are encoded); a retry that cuts the same windows again charges nothing more."""
        if items > self.items:
            self.admission._charge(self.tenant, items - self.items)
            self.items = items

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)

    def drop_encoder(self) -> None:
        """The request will not encode on an encoder after all (placement chose the LM, or no
        encoder is healthy): its encoder slot goes back now."""
        if self.encoder and not self.released:
            self.encoder = False
            self.admission._release_encoder()


@dataclass(eq=False)
class _Waiter:
    encoder: bool
    tenant: str
    seq: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, lm_slots: int, encoder_slots: int, queue: int, wait_s: float,
                 healthy_lms: Callable[[], int], healthy_encoders: Callable[[], int],
                 quota: Callable[[str], Quota] = lambda tenant: NO_QUOTA,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``lm_slots``/``encoder_slots``: admitted requests per healthy instance (0: no limit);
        ``healthy_*``: how many instances are admitted now (read at every decision); ``quota``: a
        tenant's quotas (``Tenants.quota``), read at every decision; ``clock``: ``ItemRate``'s."""
        self.lm_slots, self.encoder_slots = lm_slots, encoder_slots
        self.queue, self.wait_s = queue, wait_s
        self._healthy_lms, self._healthy_encoders = healthy_lms, healthy_encoders
        self.in_flight = 0
        self.encoding = 0
        self._held: collections.Counter[str] = collections.Counter()  # in flight, per tenant
        self._waiting: dict[str, collections.deque[_Waiter]] = {}  # per tenant, FIFO; no empty queues
        self._seq = itertools.count()
        self._served: dict[str, int] = {}  # per tenant with requests in flight or waiting: its last admission
        self.quota = quota
        self.items = ItemRate(clock)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def held_by(self, tenant: str) -> int:
        """Admitted requests of ``tenant`` in flight."""
        return self._held[tenant]

    @property
    def enabled(self) -> bool:
        return self.lm_slots > 0

    def capacity(self) -> tuple[float, float]:
        """(LM, encoder) requests that may be in flight now."""
        lms = self.lm_slots * max(1, self._healthy_lms()) if self.lm_slots else math.inf
        encoders = (self.encoder_slots * max(1, self._healthy_encoders())) if self.encoder_slots else math.inf
        return lms, encoders

    def _fits(self, encoder: bool) -> bool:
        lms, encoders = self.capacity()
        return self.in_flight < lms and (not encoder or self.encoding < encoders)

    def _capped(self, tenant: str, quota: Quota | None = None) -> bool:
        """Whether ``tenant`` has its ``max_in_flight`` requests in flight."""
        cap = (quota or self.quota(tenant)).max_in_flight
        return cap is not None and self._held[tenant] >= cap

    async def admit(self, encoder: bool, tenant: str = ANONYMOUS, items: int = 0) -> Ticket:
        """A ticket for a request of ``tenant`` (``encoder``: it will encode on an encoder; ``items``: the
        media items it carries), at once or after waiting its turn. Raises AdmissionRefused."""
        quota = self.quota(tenant)
        if self._capped(tenant, quota):
            ADMISSIONS.labels("refused_quota").inc()
            raise AdmissionRefused(429, f"tenant {tenant} has {self._held[tenant]} requests in flight, its quota "
                                        "(max_in_flight); retry later", 1)
        rate = quota.images_per_minute if items else None
        if rate is not None:
            wait = self.items.take(tenant, items, rate)
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
                self.items.give_back(tenant, items, rate)
            raise

    async def _admit(self, encoder: bool, tenant: str, quota: Quota) -> Ticket:
        if not self.enabled:
            return self._take(encoder, tenant)
        if not self._waiting and self._fits(encoder):
            ADMISSIONS.labels("admitted").inc()
            return self._take(encoder, tenant)
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
                await asyncio.wait([waiter.future], timeout=max(0.0, min(1.0, deadline - loop.time())))
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

    def _take(self, encoder: bool, tenant: str) -> Ticket:
        self.in_flight += 1
        self.encoding += encoder
        self._held[tenant] += 1
        self._served[tenant] = next(self._seq)
        self._gauges()
        return Ticket(self, encoder, tenant)

    def _release(self, ticket: Ticket) -> None:
        self.in_flight -= 1
        self.encoding -= ticket.encoder
        self._held[ticket.tenant] -= 1
        if self._held[ticket.tenant] <= 0:
            del self._held[ticket.tenant]
            if ticket.tenant not in self._waiting:
                self._served.pop(ticket.tenant, None)  # bounded by the tenants in flight or waiting
        self._gauges()
        self._wake()

    def _charge(self, tenant: str, items: int) -> None:
        """``Ticket.count_items``'s charge, against the tenant's ``images_per_minute`` as it is now."""
        rate = self.quota(tenant).images_per_minute
        if rate is not None:
            self.items.charge(tenant, items, rate)

    def _release_encoder(self) -> None:
        self.encoding -= 1
        self._gauges()
        self._wake()

    def _next(self) -> _Waiter | None:
        """The head of the queue of the waiting tenant with the fewest requests in flight per unit of its
        ``weight`` (ties: the tenant admitted least recently, so tenants take turns; then the head that has
        waited longest). A tenant at its ``max_in_flight`` is passed over: its waiters wait for one of its own
        requests to end."""
        heads = (q[0] for t, q in self._waiting.items() if not self._capped(t))
        return min(heads, key=lambda w: (self._held[w.tenant] / self.quota(w.tenant).share,
                                         self._served.get(w.tenant, -1), w.seq), default=None)

    def _wake(self) -> None:
        """Admits waiters while the next one (``_next``) fits; it is never passed over (a request that
        needs an encoder slot is not overtaken by text requests behind it)."""
        while (waiter := self._next()) is not None and self._fits(waiter.encoder):
            self._unqueue(waiter)
            if not waiter.future.done():
                ADMISSIONS.labels("admitted").inc()
                waiter.future.set_result(self._take(waiter.encoder, waiter.tenant))

    def _gauges(self) -> None:
        ADMITTED.labels("lm").set(self.in_flight)
        ADMITTED.labels("encoder").set(self.encoding)

