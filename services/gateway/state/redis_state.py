"""``RedisState``: the limits of the whole front door, held in a Redis (or Valkey) store that every
gateway process (workers on one host, replicas across hosts) reaches.

Where the truth lives: in the store (``services.gateway.state.scripts`` names its keys). Each decision
(``acquire``, ``take``) is one Lua script run atomically there, so no two processes both take the last
place; ``counts`` reads the store at the time of the call. A release reaches the store in the background
(one round trip after ``release`` returns); the process's own waiters hear of it then, the others through
the store's channel (pub/sub), and every waiter at the latest when its bounded ``wait_freed`` runs out.

Leases: every place a process holds lives as long as the process does. A heartbeat every
``heartbeat_s`` pushes the process's expiry ``lease_s`` ahead (the store's clock); a process killed with
``kill -9`` (or frozen, or cut off) stops renewing, and every place it held goes back at the first
decision after ``lease_s`` (6 s by default) from its last heartbeat, whichever process makes it.

The store unreachable (a call failing, or not answering within ``call_timeout_s``): the process switches
to its own part of every limit (``StateStoreConfig.part``: its 1/N share, or 0 with
``unreachable="closed"``), decided in memory on the leases it holds itself, with one log line and
``epd_gateway_state_store_fallbacks_total`` counting the switch, ``epd_gateway_state_store_shared`` 0
while it lasts. No call waits longer than ``call_timeout_s``, and no request is lost: a release or a
give-back never fails, it only waits for the store in the background. The heartbeat then tries the store
every ``heartbeat_s``; once it answers, the process makes the store hold exactly the leases it holds
(``SYNC``: its leases taken back meanwhile are put back, those released meanwhile are dropped), and
decisions go back to the store (one more log line). The same happens when the store answers but no
longer knows the process (it was frozen past its lease, or the store restarted empty). While one process
decides on its part and the others on the store, the front door holds at most its limit plus that part.
Rates are not put back: a store that restarts empty starts every bucket full.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping

import redis.asyncio as aredis
from prometheus_client import Counter, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from services.gateway.state import scripts
from services.gateway.state.base import Lease, SharedState, check_limits, count, fits, uncount
from services.gateway.state.bucket import Buckets
from services.gateway.state.config import StateStoreConfig

logger = logging.getLogger(__name__)

SHARED = Gauge("epd_gateway_state_store_shared", "1: limits are decided on the whole front door's counts in the "
               "state store; 0: on this process's part of them (the store unreachable)",
               multiprocess_mode="livemin")
FALLBACKS = Counter("epd_gateway_state_store_fallbacks_total", "Times this process fell back to its part of the "
                    "limits, by why", ["why"])  # unreachable | lost
STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
"""What a call to a store that is gone, refuses, or does not answer in time raises."""
LISTEN_S = 1.0
"""The listener's longest read of the store's channel before it looks whether it is closed."""
SYNC_RETRIES = 3
"""Syncs run back to back while leases keep changing under them, before waiting for the next heartbeat."""


class Mode(enum.Enum):
    SHARED = "shared"
    """Decisions are made in the store, on every process's counts."""
    LOCAL = "local"
    """The store is unreachable, or lost this process's leases: decisions on this process's part, until a
    sync makes the store hold this process's leases again."""


class RedisState(SharedState):
    """One gateway process's side of the store (the module docstring); made by ``open_state``, started and
    closed by whoever serves (its event loop runs every call, the heartbeat and the listener)."""

    def __init__(self, cfg: StateStoreConfig, clock_ms: Callable[[], int] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """``clock_ms``: the leases' and the store's rates' time in ms (None: the store's own clock, one
        for every process; tests pass their own); ``clock``: the rates' while unreachable (seconds)."""
        super().__init__()
        self.cfg = cfg
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
        ns = "{" + cfg.namespace + "}:"
        self._holders, self._count, self._prefix = ns + "holders", ns + "count", ns + "held:"
        self._held_key, self._channel, self._bucket = self._prefix + self.holder, ns + "freed", ns + "bucket:"
        self._clock_ms = clock_ms
        self._buckets = Buckets(clock) if clock else Buckets()
        self._leases: dict[str, Lease] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        self.mode = Mode.LOCAL
        self._syncing: asyncio.Future | None = None  # set while a sync is in flight
        self._kick = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()  # releases and give-backs on their way to the store
        self._client = self._pool = None
        self._scripts: dict[str, object] = {}
        self._loops: list[asyncio.Task] = []
        self._closed = False

    # -- lifecycle

    async def start(self) -> None:
        """Connects, registers this process with the store and starts the heartbeat and the listener. A
        store that does not answer is not an error (this process starts on its part, and the heartbeat
        keeps trying); a store that refuses the password is (ValueError)."""
        timeout = self.cfg.call_timeout_s
        self._pool = aredis.BlockingConnectionPool.from_url(
            self.cfg.url, max_connections=32, timeout=timeout, password=self.cfg.password(),
            socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        self._client = aredis.Redis(connection_pool=self._pool)
        self._scripts = {name: self._client.register_script(getattr(scripts, name))
                         for name in ("ACQUIRE", "RELEASE", "RENEW", "SYNC", "COUNTS", "RATE")}
        try:
            await asyncio.wait_for(self._sync_once(), timeout)
            self._set_mode(Mode.SHARED)
        except (AuthenticationError, ResponseError) as e:
            await self._disconnect()
            raise ValueError(f"the state store at {self.cfg.url} refused this gateway: {e}") from None
        except STORE_ERRORS as e:
            logger.warning("state store at %s unreachable at start (%s): each limit is held as this process's "
                           "part until it answers", self.cfg.url, type(e).__name__)
            FALLBACKS.labels("unreachable").inc()
            SHARED.set(0)
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._heartbeat(), name="state-store heartbeat"),
                       loop.create_task(self._listen(), name="state-store listener")]

    async def close(self) -> None:
        """Stops the heartbeat and the listener, and gives every lease back in one step (if the store
        answers; if not, they go back ``lease_s`` after the last heartbeat)."""
        self._closed = True
        for task in self._loops:
            task.cancel()
        if self._loops:
            await asyncio.wait(self._loops, timeout=LISTEN_S + 2 * self.cfg.call_timeout_s)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.cfg.call_timeout_s)
        self._leases.clear()
        self._held.clear()
        if self._client is not None:
            try:
                await asyncio.wait_for(self._run("SYNC", [self._holders, self._count, self._held_key],
                                                 [*self._common(), int(self.cfg.lease_s * 1000), "{}", "1"]),
                                       self.cfg.call_timeout_s)
            except STORE_ERRORS as e:
                logger.info("state store: leases of %s left to expire (%s)", self.holder, type(e).__name__)
            await self._disconnect()

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
            await self._pool.aclose()

    @property
    def shared(self) -> bool:
        return self.mode is Mode.SHARED

    # -- places

    async def acquire(self, limits: Mapping[str, int | None], amount: int = 1, force: bool = False) -> Lease | None:
        check_limits(limits, amount)
        if self.mode is Mode.LOCAL and self._syncing is not None:  # back to the store within one round trip
            await asyncio.wait([self._syncing], timeout=self.cfg.call_timeout_s)
        if self.mode is Mode.SHARED:
            lease = Lease(str(next(self._ids)), tuple(limits), amount)
            pairs = [x for key, limit in limits.items() for x in (key, "" if limit is None else limit)]
            call = self._spawn(self._call("ACQUIRE", [self._holders, self._count, self._held_key],
                                          [*self._common(), lease.id, amount, "1" if force else "0", *pairs]))
            try:
                got = await asyncio.shield(call)
            except asyncio.CancelledError:  # the caller went away: a place taken for it goes back
                call.add_done_callback(lambda done: self._orphaned(done, lease))
                raise
            if got == 1:
                self._add(lease)
                return lease
            if got == 0:
                return None
            if got == -1:
                self._fall_back("lost", "the store no longer knew this process")
        return self._acquire_locally(limits, amount, force)

    def _acquire_locally(self, limits: Mapping[str, int | None], amount: int, force: bool) -> Lease | None:
        parts = {key: None if limit is None else self.cfg.part(limit) for key, limit in limits.items()}
        if not force and not fits(self._held, parts, amount):
            return None
        lease = Lease(str(next(self._ids)), tuple(limits), amount)
        self._add(lease)
        return lease

    def _orphaned(self, call: asyncio.Task, lease: Lease) -> None:
        """A store's answer to an acquire whose caller was cancelled: a lease taken is released at once."""
        if not call.cancelled() and call.exception() is None and call.result() == 1:
            self._add(lease)
            self.release(lease)

    def _add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        count(self._held, lease)

    def release(self, lease: Lease) -> None:
        if self._leases.pop(lease.id, None) is None:
            return
        uncount(self._held, lease)
        if self.mode is Mode.SHARED:
            self._spawn(self._release_in_store(lease))
        else:
            self.freed.notify(lease.keys)

    async def _release_in_store(self, lease: Lease) -> None:
        await self._call("RELEASE", [self._count, self._held_key], [self._channel, lease.id])
        self.freed.notify(lease.keys)  # released, or (store unreachable) decided locally from now on

    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        """What every process holds on each key (while the store is unreachable: this process alone)."""
        keys = list(keys)
        if self.mode is Mode.SHARED:
            got = await self._call("COUNTS", [self._holders, self._count],
                                   [self._prefix, self._channel, self._now(), *keys])
            if got is not None:
                return {key: int(n) for key, n in zip(keys, got)}
        return {key: self._held[key] for key in keys}

    # -- rates

    async def take(self, bucket: str, items: int, per_minute: int) -> float:
        if self.mode is Mode.SHARED:
            got = await self._call("RATE", [self._bucket + bucket], [self._now(), items, per_minute, "take"])
            if got is not None:
                return float("inf") if got < 0 else got / 1000.0
        return self._buckets.take(bucket, items, self.cfg.part(per_minute))

    def charge(self, bucket: str, items: int, per_minute: int) -> None:
        if self.mode is Mode.SHARED:
            self._spawn(self._call("RATE", [self._bucket + bucket], [self._now(), items, per_minute, "charge"]))
        else:
            self._buckets.charge(bucket, items, self.cfg.part(per_minute))

    def give_back(self, bucket: str, items: int, per_minute: int) -> None:
        if self.mode is Mode.SHARED:
            self._spawn(self._call("RATE", [self._bucket + bucket], [self._now(), items, per_minute, "give"]))
        else:
            self._buckets.give_back(bucket, items, self.cfg.part(per_minute))

    # -- the store

    def _now(self) -> int | str:
        return "" if self._clock_ms is None else int(self._clock_ms())

    def _common(self) -> list:
        return [self._prefix, self._channel, self.holder, self._now()]

    async def _run(self, name: str, keys: list, args: list):
        return await self._scripts[name](keys=keys, args=args)

    async def _call(self, name: str, keys: list, args: list):
        """One script in the store, within ``call_timeout_s``; None when it failed (then this process falls
        back to its part)."""
        try:
            return await asyncio.wait_for(self._run(name, keys, args), self.cfg.call_timeout_s)
        except STORE_ERRORS as e:
            self._fall_back("unreachable", f"{name.lower()}: {type(e).__name__}")
            return None

    def _spawn(self, coro) -> asyncio.Task:
        """Runs a call to the store as a task this state tracks (``flush``, ``close``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def flush(self) -> None:
        """Waits for the releases and give-backs on their way to the store (tests, and ``close``)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _fall_back(self, why: str, detail: str) -> None:
        if self.mode is Mode.SHARED:
            FALLBACKS.labels(why).inc()
            logger.warning("state store at %s %s (%s): each limit is held as this process's part (%s) until it "
                           "answers", self.cfg.url, "unreachable" if why == "unreachable" else "lost this "
                           "process's leases", detail, self.cfg.unreachable)
        self._set_mode(Mode.LOCAL)
        self._kick.set()

    def _set_mode(self, mode: Mode) -> None:
        self.mode = mode
        SHARED.set(1 if mode is Mode.SHARED else 0)

    async def _sync_once(self) -> bool:
        """Makes the store hold exactly this process's leases; True when none changed meanwhile (those
        released meanwhile are then released in the store too)."""
        before = dict(self._leases)
        await self._run("SYNC", [self._holders, self._count, self._held_key],
                        [*self._common(), int(self.cfg.lease_s * 1000),
                         json.dumps({i: lease.to_dict() for i, lease in before.items()}), "0"])
        if set(self._leases) - set(before):
            return False
        for gone in set(before) - set(self._leases):
            self._spawn(self._release_in_store(before[gone]))
        return True

    async def _sync(self) -> None:
        self._syncing = asyncio.get_running_loop().create_future()
        try:
            for _ in range(SYNC_RETRIES):
                if await asyncio.wait_for(self._sync_once(), self.cfg.call_timeout_s):
                    logger.info("state store at %s answers again: limits are held for the whole front door "
                                "(%d lease(s) of this process held there)", self.cfg.url, len(self._leases))
                    self._set_mode(Mode.SHARED)
                    return
        except STORE_ERRORS as e:
            logger.debug("state store at %s: sync failed (%s)", self.cfg.url, type(e).__name__)
        finally:
            self._syncing.set_result(None)
            self._syncing = None

    async def _heartbeat(self) -> None:
        """Every ``heartbeat_s`` (sooner after a fall-back) until ``close``: renews this process's lease, or
        syncs. (``start`` registered it just now: the first beat comes one period later.)"""
        while not self._closed:
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), self.cfg.heartbeat_s)
                if self.mode is Mode.LOCAL:  # a fall-back: give the store a breath before the first sync
                    await asyncio.sleep(min(self.cfg.heartbeat_s, self.cfg.call_timeout_s))
            except asyncio.TimeoutError:
                pass
            if self._closed:
                return
            if self.mode is Mode.LOCAL:
                await self._sync()
                continue
            got = await self._call("RENEW", [self._holders, self._count],
                                   [*self._common(), int(self.cfg.lease_s * 1000)])
            if got == 0:
                self._fall_back("lost", "its lease ran out before a heartbeat")
                await self._sync()

    async def _listen(self) -> None:
        """Hears the store's word of places freed by any process (``FreedSignal``) until ``close``;
        resubscribes every ``heartbeat_s`` while the store is unreachable (waiters then rely on their
        bounded waits). Each read is bounded by redis' own read timeout (``LISTEN_S``), not by a
        ``wait_for`` around it, whose cancellation can be lost on Python 3.11; ``_closed`` ends the loop
        whichever way a cancellation goes."""
        while not self._closed:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(pubsub.subscribe(self._channel), self.cfg.call_timeout_s)
                while not self._closed:
                    msg = await pubsub.get_message(timeout=LISTEN_S)
                    if msg is not None and msg.get("type") == "message":
                        self.freed.notify(json.loads(msg["data"]))
            except (*STORE_ERRORS, RuntimeError, ValueError) as e:
                logger.debug("state store at %s: listener reconnects (%s)", self.cfg.url, type(e).__name__)
            finally:
                # closing a connection to a store that is gone may raise: nothing to do about it
                with contextlib.suppress(*STORE_ERRORS, RuntimeError):
                    await asyncio.wait_for(pubsub.aclose(), self.cfg.call_timeout_s)
            if not self._closed:
                await asyncio.sleep(self.cfg.heartbeat_s)
