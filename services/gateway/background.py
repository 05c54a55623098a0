"""Background Responses requests (``"background": true``): vLLM answers "queued" at once and goes on
working, so the request's admission place must outlive its HTTP answer, or a client could start any
amount of work past admission control.

``BackgroundWork`` keeps each such request's admission ``Ticket`` (and a call counted on its LM, for
load-aware routing) after the answer, and watches the response on the LM that has it (a GET of
``/v1/responses/{id}`` every ``POLL_S``..``POLL_MAX_S``). The ticket goes back when the LM reports
the response ended (completed, failed, cancelled, incomplete), when it no longer knows it (404: the
LM restarted and the work is gone), when the LM is out of the pool or unreachable for
``UNREACHABLE_S``, or at the server's deadline, ``--background-timeout-s``: then the LM is first
asked to cancel it. At most ``--lm-max-background`` background requests per generating LM are held
at once (``limit``), and one tenant holds at most its share of them: its weight's part of the weights
of every tenant the keys name (``Tenant.part``), rounded up, at least one; or, in its place, its
``max_background`` quota (keys file), the operator's word for that tenant. One more is refused before
admission (429, ``Retry-After``), with a message that names the tenant's own limit and never counts
what others hold or what the deployment holds.

Why a share of every named tenant, not of the active ones (as the body budget is shared): a
background place is held for up to ``--background-timeout-s`` and is never taken back, so a place
lent to the one tenant active now is lost to a tenant that comes a minute later, for minutes. Only a
share kept for each tenant up front guarantees that a tenant who comes finds a place, whatever another
sent before. What it costs: the shares of idle tenants stay idle. A deployment with many tenants and
few places raises ``--lm-max-background``, or gives a tenant ``max_background`` or more ``weight``.
Without keys (or with ``--api-key`` alone) there is one tenant, and its share is every place.

Where the places are counted: a place is one ``acquire`` on the admission's ``SharedState`` over
``services.gateway.state.keys.BACKGROUND`` (with ``--lm-max-background``'s limit) and the tenant's
``background`` key (with its cap), taken at ``take_place`` and held as one lease by the
``BackgroundPlace``, then by its watcher, until the work ends: with several gateway processes sharing a
store, the limit and every tenant's cap hold for the whole front door, and the places of a process that
died go back within the store's lease. (The watcher polls the LM from the process that holds the place;
a place it held when it died goes back, the work on the LM goes on.)

Owner: ``RequestCore`` makes one and closes it (``close`` cancels every watcher, which releases what
it holds). ``Admitted.close`` calls ``hold`` with the ticket of a background request its LM accepted
and its place; from then on the watcher owns the ticket and the place's lease and releases each exactly
once. Everything runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable

import grpc
from prometheus_client import Counter, Gauge

from epd.lm.v1 import lm_pb2
from services.gateway.admission import AdmissionRefused, Ticket
from services.gateway.instances import InstancePool
from services.gateway.state import keys
from services.gateway.state.base import Lease, SharedState
from services.gateway.state.local import LocalState
from services.gateway.tenants import ANONYMOUS, Tenant

logger = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "cancelled", "incomplete"})
POLL_S, POLL_MAX_S = 0.25, 2.0
"""The first poll of a held response, and the longest gap between polls (doubling in between)."""
UNREACHABLE_S = 30.0
"""An LM that answers no poll for this long has lost the work (or will be ejected): the place goes back."""
CALL_TIMEOUT_S = 10.0

HELD = Gauge("epd_gateway_background_held", "Background Responses requests holding an admission place",
             multiprocess_mode="livesum")  # with --workers: the whole gateway's (services.gateway.metrics)
ENDED = Counter("epd_gateway_background_ended_total", "Background Responses requests whose place went back, "
                "by why", ["why"])  # ended | gone | unreachable | deadline | shutdown


class BackgroundPlace:
    """One background request's place, reserved before admission; ``release`` (idempotent) when the request
    ends, after ``BackgroundWork.hold`` took it over (and its ``lease``) if its LM accepted it."""

    def __init__(self, work: BackgroundWork, tenant: str = ANONYMOUS, lease: Lease | None = None) -> None:
        self._work: BackgroundWork | None = work
        self.tenant = tenant
        self.lease = lease

    def hand_over(self) -> Lease | None:
        """The place's lease, for the watcher that holds it from now on (this place no longer gives it back)."""
        lease, self.lease = self.lease, None
        return lease

    def release(self) -> None:
        if self._work is not None:
            self._work._unreserve(self.tenant, self.hand_over())
            self._work = None


class BackgroundWork:
    def __init__(self, lms: Callable[[], InstancePool], per_lm: int, timeout_s: float,
                 generating_lms: Callable[[], int], quota: Callable[[str], Tenant] = Tenant,
                 state: SharedState | None = None) -> None:
        """``lms``: the LM pool (read when a request is held); ``per_lm``: background requests held per
        generating LM (0: no limit); ``generating_lms``: how many LMs take whole requests now (read at every
        decision); ``quota``: a tenant's quotas (``Tenants.quota``: its ``max_background`` and ``part``), read
        at every decision; ``state``: where the places are counted (default: a ``LocalState`` of this
        process; a shared one is started and closed by whoever made it)."""
        self._lms, self.per_lm, self.timeout_s = lms, per_lm, timeout_s
        self._generating_lms, self._quota = generating_lms, quota
        self.state = state if state is not None else LocalState()
        self._watchers: set[asyncio.Task] = set()
        self._reserved = 0  # places reserved by requests not yet held (``reserve``)
        self._by_tenant: collections.Counter[str] = collections.Counter()  # places reserved or held, per tenant

    @property
    def lms(self) -> InstancePool:
        return self._lms()

    @property
    def held(self) -> int:
        return len(self._watchers)

    def held_by(self, tenant: str) -> int:
        """Background places ``tenant`` has reserved or holds."""
        return self._by_tenant[tenant]

    def limit(self) -> float:
        """Background requests the deployment may hold now (``math.inf``: no limit)."""
        return self.per_lm * max(1, self._generating_lms()) if self.per_lm else math.inf

    def cap(self, tenant: str) -> tuple[float, str]:
        """The most background places ``tenant`` may hold now, and what sets it (for its refusal): its
        ``max_background`` quota, else its share of ``limit()`` (the module docstring's rule)."""
        quota = self._quota(tenant)
        if quota.max_background is not None:
            return quota.max_background, "its quota (max_background)"
        limit = self.limit()
        if limit == math.inf:
            return limit, ""
        # Rounded to a millionth first: three tenants' thirds of 3 places are 1 each, not 2.
        return max(1, math.ceil(round(limit * quota.part, 6))), "its share of the places (by weight)"

    def _limits(self, tenant: str) -> dict[str, int | None]:
        """What one place takes, each with its limit now (a tenant's cap that covers every place: none)."""
        limit, (cap, _) = self.limit(), self.cap(tenant)
        return {keys.BACKGROUND: None if limit == math.inf else int(limit),
                keys.background(tenant): int(cap) if cap < limit else None}

    def _refused(self, tenant: str, capped: bool) -> AdmissionRefused:
        """Neither message counts what others or the deployment hold (a tenant's cap that covers every place
        is the deployment's message: without keys one client's refusal would otherwise tell it how much
        everyone else holds)."""
        if capped:
            return AdmissionRefused(429, f"tenant {tenant} holds as many background responses as "
                                         f"{self.cap(tenant)[1]} allows; retry later", 5)
        return AdmissionRefused(429, "no background place is free now (--lm-max-background); retry later", 5)

    def reserve(self, tenant: str = ANONYMOUS) -> BackgroundPlace:
        """A place for one more background request of ``tenant``, taken before its admission and counted until
        the request ends (``BackgroundPlace.release``) or its watcher holds it (``hold``): requests sent at once
        cannot all pass the limit while none is held yet. Raises AdmissionRefused (429) when ``tenant`` holds
        its ``cap``, or no place is free. At once, for a caller that is not a coroutine: a ``LocalState``
        only (``take_place`` on any state)."""
        if not isinstance(self.state, LocalState):
            raise TypeError("reserve decides in memory; with a shared state, await take_place")
        limits = self._limits(tenant)
        lease = self.state.try_acquire(limits)
        if lease is None:
            key = keys.background(tenant)
            raise self._refused(tenant, limits[key] is not None and self._by_tenant[tenant] >= limits[key])
        return self._reserved_place(tenant, lease)

    async def take_place(self, tenant: str = ANONYMOUS) -> BackgroundPlace:
        """``reserve`` on any state (a shared one decides in its store: one round trip)."""
        limits = self._limits(tenant)
        lease = await self.state.acquire(limits)
        if lease is None:
            key = keys.background(tenant)
            capped = limits[key] is not None and (await self.state.counts([key]))[key] >= limits[key]
            raise self._refused(tenant, capped)
        return self._reserved_place(tenant, lease)

    def _reserved_place(self, tenant: str, lease: Lease) -> BackgroundPlace:
        self._reserved += 1
        self._count(tenant, 1)
        return BackgroundPlace(self, tenant, lease)

    def _unreserve(self, tenant: str, lease: Lease | None) -> None:
        self._reserved -= 1
        self._count(tenant, -1)
        if lease is not None:
            self.state.release(lease)

    def _count(self, tenant: str, n: int) -> None:
        self._by_tenant[tenant] += n
        if self._by_tenant[tenant] <= 0:
            del self._by_tenant[tenant]

    def hold(self, response_id: str, lm: str, ticket: Ticket, place: BackgroundPlace | None = None) -> None:
        """Takes over ``ticket`` until the background response ``response_id`` on LM ``lm`` ends, and
        ``place``'s lease (the caller still releases ``place``, which then gives nothing back). Without a
        place, the watcher counts itself (past the limits: the LM has the work already)."""
        lease = place.hand_over() if place is not None else None
        if lease is None and isinstance(self.state, LocalState):
            lease = self.state.try_acquire(self._limits(ticket.tenant), force=True)
        task = asyncio.get_running_loop().create_task(self._watch(response_id, lm, ticket, lease),
                                                      name=f"background {response_id}")
        self._watchers.add(task)
        self._count(ticket.tenant, 1)
        HELD.set(len(self._watchers))

        def done(t: asyncio.Task) -> None:
            self._watchers.discard(t)
            self._count(ticket.tenant, -1)
            HELD.set(len(self._watchers))

        task.add_done_callback(done)

    async def close(self) -> None:
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _watch(self, response_id: str, address: str, ticket: Ticket, lease: Lease | None) -> None:
        why = "shutdown"
        try:
            if lease is None:
                lease = await self.state.acquire(self._limits(ticket.tenant), force=True)
            inst = self.lms.instances.get(address)
            if inst is None:
                why = "gone"
                return
            with inst.track():
                why = await self._until_ended(response_id, address)
        finally:
            ticket.release()
            if lease is not None:
                self.state.release(lease)
            ENDED.labels(why).inc()
            logger.info("background response %s on lm %s: its place went back (%s)", response_id, address, why)

    async def _until_ended(self, response_id: str, address: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        reached = time.monotonic()
        pause = POLL_S
        while True:
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, POLL_MAX_S)
            inst = self.lms.instances.get(address)
            if inst is None or not inst.healthy:
                return "gone"
            if time.monotonic() >= deadline:
                await self._call(inst, "POST", f"/v1/responses/{response_id}/cancel")
                return "deadline"
            status, body = await self._call(inst, "GET", f"/v1/responses/{response_id}")
            if status == 0:
                if time.monotonic() - reached > UNREACHABLE_S:
                    return "unreachable"
                continue
            reached = time.monotonic()
            if status == 404:
                return "gone"
            state = body.get("status") if isinstance(body, dict) else None
            if status != 200 or state in TERMINAL:
                return "ended"

    @staticmethod
    async def _call(inst, method: str, path: str) -> tuple[int, object]:
        """One call of vLLM's Responses routes on the LM: (HTTP status, JSON body), (0, None) if unreachable."""
        req = lm_pb2.GenerateRequest(request_id=f"bg-{uuid.uuid4().hex}")
        req.openai.api, req.openai.method, req.openai.path = "http", method, path
        try:
            async for resp in inst.stub.Generate(req, timeout=CALL_TIMEOUT_S):
                with contextlib.suppress(ValueError):
                    return resp.http_status, json.loads(resp.openai)
                return resp.http_status, None
        except grpc.aio.AioRpcError as e:
            logger.debug("background poll of %s on lm %s failed: %s", path, inst.address, e.code().name)
        return 0, None
