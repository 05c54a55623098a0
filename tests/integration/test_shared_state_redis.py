"""Gateway processes that share their limits through a real redis-server (``RedisState``, the private
store ``StoreServer`` starts): they share a limit exactly, concurrent takers never pass it, a process that
dies gives its places back once its lease runs out, and a store that stops answering leaves each process
on its part of every limit within the call timeout, until the store answers again and holds every
process's leases once more. Waits are polls with generous deadlines (hang guards, not timings)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time

import pytest

from services.gateway.state.store_server import StoreServer
from tests.integration.redis_fixture import (
    MsClock,
    holding_child,
    namespace,
    peek,
    processes,
    run,
    started_store,
    until,
)

pytestmark = pytest.mark.integration

SURE = {"call_timeout_s": 10.0}
"""For tests about the shared counts: a call timeout no busy machine reaches, so no process falls back."""
STOPPED = {"heartbeat_s": 0.5, "lease_s": 5.0, **SURE}
"""For tests that stop the store: a stopped store's socket is gone, so a call fails at once (no timeout
needed); the heartbeat tries it again every 0.5 s."""


# --- the private store ---------------------------------------------------------------------------------------------


def test_the_private_store_is_this_users_alone_and_leaves_nothing_behind():
    server = started_store()
    directory = server.directory
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.password_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.join(directory, "redis.conf")).st_mode) == 0o600
        assert server.url.startswith("unix://") and os.path.exists(server.socket_path)

        async def body():
            async with peek(server) as client:
                assert await client.ping()
                with pytest.raises(Exception, match="unknown command"):
                    await client.execute_command("CONFIG", "SET", "requirepass", "")
        run(body)
    finally:
        server.stop()
    assert not os.path.exists(directory)


def test_the_store_refuses_a_client_without_its_password(store):
    async def body():
        from services.gateway.state.config import StateStoreConfig
        from services.gateway.state.redis_state import RedisState

        state = RedisState(StateStoreConfig(url=store.url, namespace=namespace()))
        with pytest.raises(ValueError, match="refused"):
            await state.start()
    run(body)


# --- shared limits -------------------------------------------------------------------------------------------------


def test_two_processes_share_one_limit_exactly(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            first = await a.acquire({"lm:1": 3, "tenant:x": None})
            second = await a.acquire({"lm:1": 3, "tenant:x": None})
            assert first and second
            assert await b.acquire({"lm:1": 3}) is not None
            assert await b.acquire({"lm:1": 3}) is None
            assert await b.counts(["lm:1", "tenant:x"]) == {"lm:1": 3, "tenant:x": 2}
            a.release(first)
            await a.flush()
            assert await b.acquire({"lm:1": 3}) is not None
            assert await a.acquire({"lm:1": 3}) is None
            assert a.shared and b.shared
    run(body)


def test_several_keys_are_taken_at_once_or_not_at_all_across_processes(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            assert await a.acquire({"lm:1": 5, "tenant:x": 1}) is not None
            assert await b.acquire({"lm:1": 5, "tenant:x": 1}) is None  # the tenant is at its cap
            assert await b.counts(["lm:1"]) == {"lm:1": 1}  # the refused request took no LM place
            assert await b.acquire({"lm:1": 5, "tenant:y": 1}) is not None
    run(body)


def test_body_bytes_are_counted_across_processes_and_force_takes_past_the_limit(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            assert await a.acquire({"body:x": 250}, amount=200)
            assert await b.acquire({"body:x": 250}, amount=100) is None
            assert await b.acquire({"body:x": 250}, amount=100, force=True)
            assert await a.counts(["body:x"]) == {"body:x": 300}
    run(body)


def test_concurrent_takers_in_two_processes_never_pass_a_limit(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            tries = [s.acquire({"lm:1": 10, f"tenant:{t}": 4}) for i in range(100) for s, t in ((a, i % 2), (b, i % 3))]
            leases = [lease for lease in await asyncio.gather(*tries) if lease is not None]
            assert len(leases) == 10
            held = await a.counts(["lm:1", "tenant:0", "tenant:1", "tenant:2"])
            assert held["lm:1"] == 10 and all(held[f"tenant:{t}"] <= 4 for t in range(3))
            assert sum(held[f"tenant:{t}"] for t in range(3)) == 10
            assert a.shared and b.shared
    run(body)


def test_an_acquire_whose_caller_went_away_leaves_no_place_taken(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            for delay in (0, 0, 0.0005, 0.001, 0.002, 0.005):
                tries = [(s, asyncio.create_task(s.acquire({"lm:1": 100}))) for s in (a, b) for _ in range(10)]
                await asyncio.sleep(delay)
                for _, task in tries:
                    task.cancel()
                await asyncio.gather(*(task for _, task in tries), return_exceptions=True)
                for state, task in tries:
                    if not task.cancelled():  # answered before the cancel came: the caller gives it back
                        state.release(task.result())
                for state in (a, b):
                    await state.flush()
            assert await a.counts(["lm:1"]) == {"lm:1": 0}
    run(body)


def test_a_rate_is_one_bucket_for_every_process(store):
    async def body():
        clock = MsClock()
        async with processes(store, 2, clock_ms=clock, **SURE) as (a, b):
            assert await a.take("tenant:x", 6, 10) == 0.0
            assert await b.take("tenant:x", 5, 10) == pytest.approx(6.0)
            assert await b.take("tenant:x", 11, 10) == float("inf")
            a.give_back("tenant:x", 2, 10)
            await a.flush()
            assert await b.take("tenant:x", 5, 10) == pytest.approx(0.0)
            clock.now += 30_000
            assert await b.take("tenant:x", 5, 10) == 0.0
    run(body)


def test_a_process_hears_of_a_place_another_process_freed(store):
    async def body():
        async with processes(store, 2, **SURE) as (a, b):
            lease = await a.acquire({"lm:1": 1})
            async with peek(store) as client:
                channel = "{" + b.cfg.namespace + "}:freed"
                await until(lambda: _subscribers(client, channel, 2))
            heard = []
            b.on_freed(heard.append)
            waiting = asyncio.create_task(b.wait_freed(60))
            a.release(lease)
            assert await waiting is True
            assert frozenset({"lm:1"}) in heard
            assert await b.acquire({"lm:1": 1}) is not None
    run(body)


async def _subscribers(client, channel: str, n: int) -> bool:
    return dict(await client.pubsub_numsub(channel)).get(channel, 0) >= n


# --- leases --------------------------------------------------------------------------------------------------------


def test_the_places_of_a_process_that_stopped_renewing_go_back_when_its_lease_runs_out(store):
    async def body():
        clock = MsClock()
        ns = namespace()
        # heartbeats far apart: on the fake clock, nobody renews unless the test says so
        fields = {"clock_ms": clock, "heartbeat_s": 100.0, "lease_s": 300.0, "namespace": ns, **SURE}
        async with processes(store, 1, **fields) as (silent,):
            assert await silent.acquire({"lm:1": 1}) is not None
            clock.now += 300_000 - 1  # the last moment of its lease
            async with processes(store, 1, **fields) as (other,):
                assert await other.acquire({"lm:1": 1}) is None
                clock.now += 2
                assert await other.acquire({"lm:1": 1}) is not None
                assert await other.counts(["lm:1"]) == {"lm:1": 1}
    run(body)


def test_a_process_killed_with_sigkill_gives_its_places_back_within_its_lease(store):
    ns = namespace()
    child = holding_child(store, ns, "lm:1")  # heartbeat 1 s, lease 10 s

    async def body():
        async with processes(store, 1, namespace=ns, **SURE) as (other,):
            assert await other.acquire({"lm:1": 1}) is None  # the child holds it, and renews it
            child.send_signal(signal.SIGKILL)
            child.wait()
            await until(lambda: other.acquire({"lm:1": 1}), timeout=60)
    try:
        run(body)
    finally:
        child.kill()
        child.wait()


def test_closing_a_process_gives_back_its_places_at_once(store):
    async def body():
        ns = namespace()
        async with processes(store, 1, namespace=ns, **SURE) as (other,):
            async with processes(store, 1, namespace=ns, **SURE) as (leaving,):
                assert await leaving.acquire({"lm:1": 1}) is not None
            assert await other.acquire({"lm:1": 1}) is not None
    run(body)


# --- the store unreachable -----------------------------------------------------------------------------------------


def test_a_frozen_store_leaves_each_process_its_part_within_the_call_timeout_then_holds_every_lease_again(own_store):
    async def body():
        # a frozen store answers nothing: only the call timeout tells (2 s: short, yet past a busy machine's stalls)
        fields = {"call_timeout_s": 2.0, "heartbeat_s": 0.5, "lease_s": 5.0}
        async with processes(own_store, 2, **fields) as (a, b):
            held = [await a.acquire({"lm:1": 4})]
            os.kill(own_store.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                tries = [await a.acquire({"lm:1": 4}) for _ in range(3)]
                assert time.monotonic() - started < 60  # never a hang: a call gives up after 2 s
                assert not a.shared
                # a's part of 4 is 2: it held 1, takes 1 more, then is refused
                assert tries[0] is not None and tries[1:] == [None, None]
                held.append(tries[0])
                a.release(held.pop())  # a release never fails, the store is told later
                mine = [await b.acquire({"lm:1": 4}) for _ in range(3)]
                assert mine[0] and mine[1] and mine[2] is None
            finally:
                os.kill(own_store.pid, signal.SIGCONT)
            await until(lambda: a.shared and b.shared)
            assert await a.counts(["lm:1"]) == {"lm:1": 3}  # a's 1 and b's 2, as they hold them
            assert await a.acquire({"lm:1": 4}) is not None
            assert await b.acquire({"lm:1": 4}) is None  # the whole limit again, no more parts
    run(body)


def test_a_store_that_restarts_empty_is_given_back_every_process_s_leases(own_store):
    async def body():
        async with processes(own_store, 2, **STOPPED) as (a, b):
            assert await a.acquire({"lm:1": 4}) and await b.acquire({"lm:1": 4})
            own_store.stop(remove=False)
            assert await a.acquire({"lm:1": 4}) is not None  # its part (2): one more
            assert not a.shared
            own_store.start()
            await until(lambda: a.shared and b.shared)
            assert await b.counts(["lm:1"]) == {"lm:1": 3}
            assert await b.acquire({"lm:1": 4}) is not None
            assert await a.acquire({"lm:1": 4}) is None
    run(body)


def test_a_process_that_starts_while_the_store_is_down_starts_on_its_part_and_joins_later(own_store):
    async def body():
        own_store.stop(remove=False)
        async with processes(own_store, 2, **STOPPED) as (a, b):
            assert not a.shared
            assert await a.acquire({"lm:1": 3}) and await a.acquire({"lm:1": 3})  # index 0: 2 of 3
            assert await a.acquire({"lm:1": 3}) is None
            own_store.start()
            await until(lambda: a.shared and b.shared)
            assert await b.acquire({"lm:1": 3}) is not None
            assert await b.acquire({"lm:1": 3}) is None
    run(body)


def test_a_store_that_fails_closed_refuses_every_limited_place_while_unreachable(own_store):
    async def body():
        async with processes(own_store, 1, unreachable="closed", **STOPPED) as (a,):
            own_store.stop(remove=False)
            assert await a.acquire({"lm:1": 4}) is None
            assert await a.acquire({"tenant:x": None}) is not None  # counted, not limited
            assert await a.take("tenant:x", 1, 100) == float("inf")
            own_store.start()
            await until(lambda: a.shared)
            assert await a.acquire({"lm:1": 4}) is not None
    run(body)


def test_a_store_server_stopped_is_restarted_on_the_same_socket_and_password():
    server = StoreServer(maxmemory_mib=16)
    try:
        server = started_store()
        url, secret = server.url, server.config().password()
        server.stop(remove=False)
        server.start()
        assert (server.url, server.config().password()) == (url, secret)
    finally:
        server.stop()
