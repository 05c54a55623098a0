"""Request bodies before admission: how many are read at once, how many bytes they may hold, and
how long one may take, on both public ports. Anyone who can reach the gateway gets this far.

- A body larger than ``GatewayConfig.max_body_bytes`` (the largest media item one modality
  allows, base64, and some text) is refused with 413: by its Content-Length before a byte is
  read, else as soon as it grows past the limit.
- At most ``--max-body-readers`` bodies are being read at once; one more is refused at once
  (503, Retry-After: 1).
- A body must arrive within ``--body-timeout-s``, and after a grace of ``RATE_GRACE_S`` at no
  less than ``--body-min-rate-kib`` per second (a slow drip is cut off within seconds: 408).
- The budget, ``--body-memory-mib``, is charged for bytes a client delivered, never for a length it
  declared: a body being read holds what has arrived (once per byte, chunk by chunk); once it is all
  there it holds ``BODY_COPIES`` times its size (the text, what is parsed from it, the media decoded
  from that), plus twice the bytes of any media it fetched (``BodyLease.charge_fetched``), until its answer
  ends; a non-streaming answer's bytes are added while they wait to be sent (``BodyLease.hold``).
  So what all requests hold is bounded, read, parsed, waiting for admission or in flight, and a
  client that declares 64 MiB and drips holds only what it dripped (and the minimum rate below
  cuts it off). Room that is not there within ``WAIT_S`` is a 503. The budget is not
  first-come-first-served: a small body never waits behind a large one.
- The budget is shared fairly between tenants (``BodyShares``): a tenant may hold at most its
  ``body_mib`` quota (keys file) if it has one, and otherwise its weight's part of the budget among
  the tenants *active* now (holding some of it or waiting for room, itself counted; ``weight`` in
  the keys file, 1 by default): alone, all of it; beside two others of the same weight, a third. A tenant whose request would go past that is refused at once (429,
  ``Retry-After: 1``: that tenant is over its share, the others get the room), except for its
  first body: a tenant holding no other body may always take one (up to the budget itself), so
  every tenant can make progress whatever its quota or the number of tenants. Nothing already held
  is taken back: a tenant that filled the budget alone keeps what it holds, but none of its
  requests grows once another tenant is waiting, so what it gives back goes to the others. One
  tenant (a gateway without keys): it is always alone, and this changes nothing.

REST reads the body itself (aiohttp pauses the socket while a handler is not reading, so an
unread body holds at most its buffer). The native gRPC API's calls go through ``grpc_intake.GrpcIntake``, a
server interceptor: it gives each GatewayService call a handler that takes one of
``GRPC_READERS`` read slots (waiting ``WAIT_S`` for one; at most ``GRPC_READERS_PER_TENANT`` for
one named tenant and ``GRPC_READERS_PER_CONNECTION`` for one connection, ``context.peer()``: past
either a wait of ``WAIT_S`` for one of its own, then 429 RESOURCE_EXHAUSTED) and twice the largest body from the budget *before* grpc reads the
request message (a request-streaming handler; grpc buffers only its flow-control window until the
handler reads), reads it under the deadline, and then keeps what the message needs. What a gRPC
call's message cannot do, unlike a REST body, is show its progress: a call that never sends its
message holds its slot until ``--body-timeout-s``, so at most ``GRPC_READERS`` such calls stall
the gRPC API (never the REST one) at a time, and one connection or one tenant only half of them.

Owner: ``server.serve`` makes one ``Intake``; the REST routes and ``GrpcIntake`` use it on the
gateway's event loop. A ``BodyLease`` is released by whoever took it when the request ends
(idempotent); ``charge_fetched`` charges the media a request fetched to its lease.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import grpc
from aiohttp import web
from prometheus_client import Counter, Gauge

from services.common.budget import ByteBudget
from services.common.errors import EPDError
from services.gateway.auth import CURRENT_TENANT
from services.gateway.config import BODY_COPIES, GatewayConfig
from services.gateway.tenants import ANONYMOUS, Tenant

logger = logging.getLogger(__name__)

WAIT_S = 1.0
"""How long a request waits for room in the body budget before it is refused."""
CHUNK = 64 << 10
RATE_GRACE_S = 2.0
"""Seconds a body may take before the minimum upload rate applies."""
GRPC_READERS = 4
"""gRPC request messages being received at once (each holds twice the largest body until read)."""
GRPC_READERS_PER_TENANT = GRPC_READERS // 2
"""Of those, what one named tenant may hold (a gateway without keys: its one tenant, all of them): a
tenant that floods the gRPC API with messages it never finishes leaves the others room."""
GRPC_READERS_PER_CONNECTION = GRPC_READERS // 2
"""Of those, what one connection (``context.peer()``: address and port) may hold, whatever its tenant: one
client's connection cannot take every slot, also on a gateway without keys."""
FETCHED_COPIES = 2
"""Budget charged per fetched media byte: the bytes, and their base64 in an LM body."""

REFUSED = Counter("epd_gateway_bodies_refused_total", "Request bodies refused before admission", ["reason"])
HELD = Gauge("epd_gateway_body_bytes_held", "Budget held by request bodies (BODY_COPIES per byte)",
             multiprocess_mode="livesum")  # with --workers: the whole gateway's (services.gateway.metrics)
READING = Gauge("epd_gateway_bodies_reading", "Request bodies being read", multiprocess_mode="livesum")
SLOW_READERS = Counter("epd_gateway_slow_readers_total", "Answers cut off because the client did not read them "
                       "in time (--answer-timeout-s, --answer-min-rate-kib), REST and gRPC")

_CODES = {408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


class BodyRefused(EPDError):
    """A body the gateway will not take: ``status`` 408, 413, 429 (its tenant's share) or 503, with a
    message (the gRPC API's error boundary answers the matching code)."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.code = _CODES[status]
        REFUSED.labels(reason).inc()


class BodyShares:
    """Each tenant's part of the body budget (the module docstring's rule): what it holds, how many leases
    it has open, and who waits for room. Owned by ``Intake``; its leases report to it, on the event loop."""

    def __init__(self, capacity: int, quota: Callable[[str], Tenant] = Tenant) -> None:
        """``quota``: a tenant's quotas (``Tenants.quota``: its ``body_mib``), read at every decision."""
        self.capacity, self._quota = capacity, quota
        self.held: collections.Counter[str] = collections.Counter()
        self.leases: collections.Counter[str] = collections.Counter()
        self.waiting: collections.Counter[str] = collections.Counter()

    def active(self, tenant: str) -> int:
        """Tenants holding some of the budget or waiting for it, ``tenant`` counted."""
        return len({tenant, *(+self.held), *(+self.waiting)})

    def limit(self, tenant: str) -> tuple[int, str]:
        """What ``tenant`` may hold now, and why (for its refusal)."""
        own = self._quota(tenant).body_bytes
        if own is not None:
            return own, "its body_mib quota"
        active = {tenant, *(+self.held), *(+self.waiting)}
        if len(active) == 1:
            return self.capacity, "the whole --body-memory-mib, alone"
        weights = {t: self._quota(t).share for t in active}
        part = weights[tenant] / sum(weights.values())
        return int(self.capacity * part), f"its share of --body-memory-mib ({part:.0%}, {len(active)} tenants active)"

    def refusal(self, tenant: str, nbytes: int) -> BodyRefused | None:
        """Why ``tenant`` may not take ``nbytes`` more (None: it may). Its only lease may always grow, and
        a share of the whole budget is the budget's to refuse (it waits, then 503: one tenant as before)."""
        if self.leases[tenant] <= 1:
            return None
        limit, why = self.limit(tenant)
        if limit >= self.capacity or self.held[tenant] + nbytes <= limit:
            return None
        return BodyRefused(429, f"tenant {tenant} holds {self.held[tenant] >> 20} MiB of request bodies, {limit >> 20} "
                                f"MiB being {why}; retry later", "tenant")

    def count(self, counter: collections.Counter[str], tenant: str, n: int) -> None:
        counter[tenant] += n
        if counter[tenant] <= 0:
            del counter[tenant]


class KeyedSlots:
    """At most ``per_key`` slots held at once per key (a tenant, a connection): one more caller waits up to
    ``WAIT_S`` for one of its own key's, then is refused (``refusal(key)``), holding nothing. A key's entry
    lives while it has callers holding or waiting, so the table is bounded by the calls in flight."""

    def __init__(self, per_key: int, refusal: Callable[[str], BodyRefused]) -> None:
        self.per_key, self._refusal = per_key, refusal
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._callers: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._slots)

    async def acquire(self, key: str) -> None:
        slots = self._slots.setdefault(key, asyncio.Semaphore(self.per_key))
        self._callers[key] += 1
        try:
            await asyncio.wait_for(slots.acquire(), WAIT_S)
        except BaseException as e:
            self._leave(key)
            if isinstance(e, asyncio.TimeoutError):
                raise self._refusal(key) from None
            raise

    def release(self, key: str) -> None:
        self._slots[key].release()
        self._leave(key)

    def _leave(self, key: str) -> None:
        self._callers[key] -= 1
        if self._callers[key] <= 0:
            del self._callers[key], self._slots[key]


class BodyLease:
    """A request's share of the body budget, charged to its tenant (``BodyShares``); ``release`` when its
    answer ends (idempotent)."""

    def __init__(self, budget: ByteBudget, tenant: str = ANONYMOUS, shares: BodyShares | None = None) -> None:
        self._budget, self.tenant = budget, tenant
        self._shares = shares or BodyShares(budget.capacity)
        self._shares.count(self._shares.leases, tenant, 1)
        self._open = True
        self.nbytes = 0

    async def charge_fetched(self, nbytes: int) -> None:
        """Charges media the request fetched (http(s) URLs: held as long as the request, and its body's
        share does not cover them). Raises BodyRefused (503)."""
        await self.grow(FETCHED_COPIES * nbytes)

    async def grow(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        shares = self._shares
        if (refused := shares.refusal(self.tenant, nbytes)) is not None:
            raise refused
        if nbytes > self._budget.capacity:
            got = False
        else:
            shares.count(shares.waiting, self.tenant, 1)
            try:
                got = await self._budget.acquire(nbytes, WAIT_S)
            finally:
                shares.count(shares.waiting, self.tenant, -1)
        if not got:
            raise BodyRefused(503, f"the gateway holds {self._budget.used >> 20} MiB of requests, its limit "
                                   "(--body-memory-mib); retry later", "memory")
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self._shares.count(self._shares.held, self.tenant, nbytes)
        HELD.inc(nbytes)

    async def resize(self, nbytes: int) -> None:
        """Holds exactly ``nbytes``: gives back what is over, takes what is missing."""
        if nbytes < self.nbytes:
            self._budget.release(self.nbytes - nbytes)
            self._add(nbytes - self.nbytes)
        else:
            await self.grow(nbytes - self.nbytes)

    def hold(self, nbytes: int) -> None:
        """Charges ``nbytes`` now, even past the budget's capacity or the tenant's share: bytes the gateway
        already holds (an answer waiting to be sent) must be counted, not refused; requests that come next
        wait or are refused until they are gone."""
        if nbytes > 0:
            self._budget.force(nbytes)
            self._add(nbytes)

    def release(self) -> None:
        if self.nbytes:
            self._budget.release(self.nbytes)
            self._add(-self.nbytes)
        if self._open:
            self._open = False
            self._shares.count(self._shares.leases, self.tenant, -1)


class Intake:
    """The limits above, shared by the REST and gRPC front ends."""

    def __init__(self, cfg: GatewayConfig, quota: Callable[[str], Tenant] = Tenant) -> None:
        """``quota``: a tenant's quotas (``Tenants.quota``; by default none), for its share of the budget."""
        self.cfg = cfg
        self.max_body = cfg.max_body_bytes
        self.budget = ByteBudget(int(cfg.body_memory_mib * (1 << 20)), fifo=False)
        self.shares = BodyShares(self.budget.capacity, quota)
        self.reading = 0
        self.grpc_reading = 0
        self._grpc_slots = asyncio.Semaphore(GRPC_READERS)
        self._tenant_slots = KeyedSlots(GRPC_READERS_PER_TENANT, lambda tenant: BodyRefused(
            429, f"tenant {tenant} is sending {GRPC_READERS_PER_TENANT} gRPC request messages at once, its share; "
                 "retry later", "tenant"))
        self._peer_slots = KeyedSlots(GRPC_READERS_PER_CONNECTION, lambda peer: BodyRefused(
            429, f"this connection is sending {GRPC_READERS_PER_CONNECTION} gRPC request messages at once, its "
                 "share; retry later", "connection"))
        self.min_rate = cfg.body_min_rate_kib * 1024

    def start_reading(self) -> None:
        if self.reading >= self.cfg.max_body_readers:
            raise BodyRefused(503, f"the gateway is reading {self.reading} request bodies, its limit "
                                   "(--max-body-readers); retry later", "readers")
        self.reading += 1
        READING.inc()

    def done_reading(self) -> None:
        self.reading -= 1
        READING.dec()

    def _too_large(self, n: int) -> BodyRefused:
        return BodyRefused(413, f"request body of {n} bytes or more is larger than the {self.max_body} allowed "
                                "(set by --max-image-bytes, --max-audio-bytes and --max-video-bytes)", "size")

    def _too_slow(self, got: int, elapsed: float) -> BodyRefused:
        return BodyRefused(408, f"the request body arrived too slowly ({got} bytes in {elapsed:.1f} s; at least "
                                f"{self.cfg.body_min_rate_kib:g} KiB/s after {RATE_GRACE_S:g} s, all of it within "
                                f"{self.cfg.body_timeout_s:g} s: --body-min-rate-kib, --body-timeout-s)", "timeout")

    def lease(self, tenant: str = ANONYMOUS) -> BodyLease:
        """An empty lease of ``tenant``'s on the budget."""
        return BodyLease(self.budget, tenant, self.shares)

    async def read(self, request: web.Request) -> tuple[bytes, BodyLease]:
        """A REST request's body and its lease, charged to its tenant (``CURRENT_TENANT``, set by the
        authentication middleware). Raises BodyRefused (nothing held then)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise self._too_large(declared)
        self.start_reading()
        lease, buf = self.lease(CURRENT_TENANT.get()), bytearray()
        try:
            start = time.monotonic()
            while True:
                try:
                    parts = [await asyncio.wait_for(request.content.read(CHUNK), 0.5)]
                except asyncio.TimeoutError:
                    parts = []  # nothing came for 0.5 s: judge the pace below
                if parts == [b""]:
                    break
                # What else has arrived, before the pace is judged: an event loop that stalled while the
                # body arrived is not the client's slowness. Each piece is copied once, into the buffer.
                while parts and (more := request.content.read_nowait(CHUNK)):
                    parts.append(more)
                if got := sum(map(len, parts)):
                    if len(buf) + got > (declared if declared is not None else self.max_body):
                        raise self._too_large(len(buf) + got)
                    await lease.grow(got)  # what arrived, once: the buffer holds it
                    for part in parts:
                        buf += part
                    if request.content.at_eof():
                        break
                elapsed = time.monotonic() - start
                if elapsed > self.cfg.body_timeout_s or (elapsed > RATE_GRACE_S and
                                                         len(buf) < self.min_rate * (elapsed - RATE_GRACE_S)):
                    raise self._too_slow(len(buf), elapsed)
            await lease.resize(BODY_COPIES * len(buf))  # all there: parsing and decoding make the copies
        except BaseException:
            lease.release()
            raise
        finally:
            self.done_reading()
        return bytes(buf), lease

    async def reserve_message(self, tenant: str = ANONYMOUS, peer: str = "") -> BodyLease:
        """A gRPC call's lease for its one request message, before grpc reads it: a read slot and
        twice the largest body (the message as grpc holds it, and its deserialized copy); a named
        ``tenant`` gets at most ``GRPC_READERS_PER_TENANT`` slots at once, and one
        connection (``peer``: its ``context.peer()``) ``GRPC_READERS_PER_CONNECTION``: one more of either's
        calls waits up to ``WAIT_S`` for one of them (a burst of small messages multiplexed on one
        connection is read in turn), then 429. Raises BodyRefused (nothing held then);
        ``done_grpc_reading(tenant, peer)`` gives the slot back."""
        await self._tenant_slot(tenant)
        try:
            await self._peer_slots.acquire(peer)
        except BaseException:
            self._release_tenant(tenant)
            raise
        try:
            return await self._reserve_message(tenant)
        except BaseException:
            self._release_reader(tenant, peer)
            raise

    async def _tenant_slot(self, tenant: str) -> None:
        """One of a named ``tenant``'s ``GRPC_READERS_PER_TENANT`` read slots (``KeyedSlots``: a tenant's burst
        of small calls is read in turn, not refused)."""
        if tenant != ANONYMOUS:
            await self._tenant_slots.acquire(tenant)

    def _release_tenant(self, tenant: str) -> None:
        if tenant != ANONYMOUS:
            self._tenant_slots.release(tenant)

    def _release_reader(self, tenant: str, peer: str) -> None:
        self._release_tenant(tenant)
        self._peer_slots.release(peer)

    async def _reserve_message(self, tenant: str) -> BodyLease:
        try:
            await asyncio.wait_for(self._grpc_slots.acquire(), WAIT_S)
        except asyncio.TimeoutError:
            raise BodyRefused(503, f"the gateway is receiving {self.grpc_reading} gRPC request messages, its limit; "
                                   "retry later", "readers") from None
        try:
            self.start_reading()
        except BodyRefused:
            self._grpc_slots.release()
            raise
        self.grpc_reading += 1
        lease = self.lease(tenant)
        try:
            await lease.grow(2 * self.max_body)
        except BaseException:
            lease.release()
            self._done_slot()
            raise
        return lease

    def done_grpc_reading(self, tenant: str = ANONYMOUS, peer: str = "") -> None:
        self._release_reader(tenant, peer)
        self._done_slot()

    def _done_slot(self) -> None:
        self.grpc_reading -= 1
        self._grpc_slots.release()
        self.done_reading()
