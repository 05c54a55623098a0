"""The gateway's shared state without a store: ``LocalState`` (one process's limits in memory: several
keys taken at once or not at all, leases given back once, word of freed places, rates as token buckets
on a fake clock), ``StateStoreConfig`` (its checks, and each process's part of a limit while the store is
unreachable) and ``open_state``'s choice."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import pytest

from services.gateway.state import LocalState, StateStoreConfig, open_state

pytestmark = pytest.mark.unit


class Clock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(body):
    return asyncio.run(asyncio.wait_for(body(), 30))


# --- places --------------------------------------------------------------------------------------------------------


def test_a_place_is_taken_on_every_key_at_once_or_on_none():
    async def body():
        state = LocalState()
        first = await state.acquire({"lm": 2, "tenant:a": 1})
        assert first is not None
        # the LM has room, the tenant has not: nothing is taken, the LM's count stays
        assert await state.acquire({"lm": 2, "tenant:a": 1}) is None
        assert await state.counts(["lm", "tenant:a"]) == {"lm": 1, "tenant:a": 1}
        assert await state.acquire({"lm": 2, "tenant:b": 1}) is not None
        assert await state.acquire({"lm": 2, "tenant:c": 1}) is None  # now the LM is full
        assert await state.counts(["lm", "tenant:c"]) == {"lm": 2, "tenant:c": 0}
    run(body)


def test_a_key_without_a_limit_is_counted_but_never_refuses():
    async def body():
        state = LocalState()
        leases = [await state.acquire({"tenant:a": None}) for _ in range(50)]
        assert all(leases)
        assert await state.counts(["tenant:a"]) == {"tenant:a": 50}
    run(body)


def test_amounts_count_bytes_against_a_limit_and_force_takes_past_it():
    async def body():
        state = LocalState()
        assert await state.acquire({"body:a": 250}, amount=100)
        assert await state.acquire({"body:a": 250}, amount=100)
        assert await state.acquire({"body:a": 250}, amount=100) is None
        assert await state.acquire({"body:a": 250}, amount=100, force=True)
        assert await state.counts(["body:a"]) == {"body:a": 300}
    run(body)


def test_a_lease_goes_back_once_however_often_it_is_released():
    async def body():
        state = LocalState()
        a = await state.acquire({"lm": 2})
        b = await state.acquire({"lm": 2})
        state.release(a)
        state.release(a)
        assert await state.counts(["lm"]) == {"lm": 1}
        assert await state.acquire({"lm": 2}) is not None
        assert await state.acquire({"lm": 2}) is None
        state.release(b)
        assert await state.counts(["lm"]) == {"lm": 1}
    run(body)


def test_acquire_refuses_a_request_for_nothing():
    async def body():
        state = LocalState()
        with pytest.raises(ValueError):
            await state.acquire({})
        with pytest.raises(ValueError):
            await state.acquire({"lm": 1}, amount=0)
    run(body)


def test_close_gives_back_every_lease_still_held():
    async def body():
        state = LocalState()
        for _ in range(3):
            await state.acquire({"lm": None, "tenant:a": 5})
        await state.close()
        assert await state.counts(["lm", "tenant:a"]) == {"lm": 0, "tenant:a": 0}
    run(body)


# --- word of freed places ------------------------------------------------------------------------------------------


def test_a_waiter_hears_of_a_release_and_a_callback_gets_the_keys_freed():
    async def body():
        state = LocalState()
        heard: list[frozenset[str]] = []
        state.on_freed(heard.append)
        lease = await state.acquire({"lm": 1, "tenant:a": None})
        waiter = asyncio.create_task(state.wait_freed(30))
        await asyncio.sleep(0)
        assert not waiter.done()
        state.release(lease)
        assert await waiter is True
        assert heard == [frozenset({"lm", "tenant:a"})]
    run(body)


def test_a_wait_for_a_freed_place_is_bounded_when_none_is_freed():
    async def body():
        assert await LocalState().wait_freed(0.01) is False
    run(body)


def test_a_listener_that_raises_does_not_stop_the_others():
    async def body():
        state = LocalState()
        heard = []
        state.on_freed(lambda keys: 1 / 0)
        state.on_freed(heard.append)
        state.release(await state.acquire({"lm": 1}))
        assert heard == [frozenset({"lm"})]
    run(body)


# --- rates ---------------------------------------------------------------------------------------------------------


def test_a_rate_bucket_holds_a_minutes_worth_and_refills_at_its_rate():
    async def body():
        clock = Clock()
        state = LocalState(clock)
        assert await state.take("tenant:a", 6, 10) == 0.0
        assert await state.take("tenant:a", 5, 10) == pytest.approx(6.0)  # one item short: 6 s at 10/min
        assert await state.take("tenant:b", 5, 10) == 0.0  # buckets are per name
        clock.now += 6.0
        assert await state.take("tenant:a", 5, 10) == 0.0
        assert await state.take("tenant:a", 11, 10) == math.inf  # more than the bucket holds: never
    run(body)


def test_items_given_back_can_be_taken_again_at_once():
    async def body():
        state = LocalState(Clock())
        assert await state.take("tenant:a", 10, 10) == 0.0
        assert await state.take("tenant:a", 4, 10) > 0
        state.give_back("tenant:a", 4, 10)
        assert await state.take("tenant:a", 4, 10) == 0.0
    run(body)


# --- config --------------------------------------------------------------------------------------------------------


def test_the_parts_of_a_limit_add_up_to_the_limit_over_every_process():
    for processes in (1, 2, 3, 7):
        for limit in (0, 1, 2, 5, 10, 64):
            parts = [StateStoreConfig(processes=processes, index=i).part(limit) for i in range(processes)]
            assert sum(parts) == limit and max(parts) - min(parts) <= 1


def test_a_store_that_fails_closed_gives_every_process_no_part():
    assert StateStoreConfig(processes=2, index=0, unreachable="closed").part(10) == 0


@pytest.mark.parametrize("fields, words", [
    ({"url": "http://store:6379"}, "scheme"),
    ({"url": "redis://:secret@store:6379"}, "password-file"),
    ({"unreachable": "open"}, "share, closed"),
    ({"heartbeat_s": 2.0, "lease_s": 3.0}, "twice"),
    ({"processes": 2, "index": 2}, "index"),
    ({"call_timeout_s": 0}, "call_timeout_s"),
    ({"namespace": "a b"}, "namespace"),
])
def test_a_config_that_cannot_hold_is_refused_saying_why(fields, words):
    with pytest.raises(ValueError, match=words):
        StateStoreConfig(**fields)


def test_the_password_comes_from_the_first_line_of_its_file(tmp_path):
    path = tmp_path / "password"
    path.write_text("s3cret\nignored\n")
    assert StateStoreConfig(url="unix:///x.sock", password_file=str(path)).password() == "s3cret"
    assert StateStoreConfig(url="unix:///x.sock").password() is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="no password"):
        StateStoreConfig(url="unix:///x.sock", password_file=str(path)).password()


def test_without_a_store_the_state_is_the_processs_own_memory_and_no_redis_client_is_imported():
    assert isinstance(open_state(StateStoreConfig()), LocalState)
    code = "import sys, services.gateway.state as s; s.open_state(s.StateStoreConfig()); print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
