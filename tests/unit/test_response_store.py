"""The LM's bound on vLLM's stored Responses (services/lm/response_store.py): the oldest ended responses
are forgotten past --responses-store-max / --responses-store-mib, each tenant's within its share by weight
(one tenant never evicts another's within its share), work in progress never is, and input messages of a
response vLLM never stored are dropped. The store's names are checked in vLLM's source."""

from __future__ import annotations

import asyncio
import inspect
import typing
from types import SimpleNamespace

import pytest

from services.lm.response_store import ENDED, STORES, StoredResponses, weigh

pytestmark = pytest.mark.unit


def test_the_stores_are_where_vllm_keeps_them():
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    init = inspect.getsource(OpenAIServingResponses.__init__)
    for name in (*STORES, "response_store_lock", "enable_store"):
        assert f"self.{name}" in init, name
    statuses = set(typing.get_args(ResponsesResponse.model_fields["status"].annotation))
    assert ENDED < statuses and {"queued", "in_progress"} <= statuses - ENDED, statuses


def _serving(enabled: bool = True):
    return SimpleNamespace(enable_store=enabled, response_store={}, msg_store={}, event_store={},
                           response_store_lock=asyncio.Lock())


def _put(serving, rid: str, status: str, text: str = "x") -> None:
    serving.response_store[rid] = SimpleNamespace(id=rid, status=status, text=text)
    serving.msg_store[rid] = [{"role": "user", "content": text}]
    serving.event_store[rid] = ([], None)


def test_the_oldest_ended_responses_are_forgotten_past_the_entry_bound_and_work_in_progress_stays():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=3, max_bytes=1 << 30)
        _put(serving, "resp_busy", "in_progress")
        for i in range(5):
            _put(serving, f"resp_{i}", "completed")
            await stored.trim()
        assert list(serving.response_store) == ["resp_busy", "resp_3", "resp_4"]
        for name in STORES:  # every store of a forgotten response is emptied, not only the response
            assert set(getattr(serving, name)) == {"resp_busy", "resp_3", "resp_4"}, name
        # Only work in progress left over the bound: nothing more can go, and nothing does.
        stored.max_entries = 0
        await stored.trim()
        assert list(serving.response_store) == ["resp_busy"]
        serving.response_store["resp_busy"].status = "cancelled"  # ended now: it may go
        await stored.trim()
        assert not serving.response_store and stored.nbytes == 0

    asyncio.run(run())


def test_the_byte_bound_counts_a_response_and_its_input_messages():
    async def run():
        serving = _serving()
        big = "y" * 10_000
        one = weigh(SimpleNamespace(status="completed", text=big)) + weigh([{"role": "user", "content": big}])
        stored = StoredResponses(serving, max_entries=100, max_bytes=int(2.5 * one))
        for i in range(4):
            _put(serving, f"resp_{i}", "completed", big)
            await stored.trim()
        assert list(serving.response_store) == ["resp_2", "resp_3"]
        assert 2 * 20_000 < stored.nbytes <= stored.max_bytes

    asyncio.run(run())


def test_input_messages_of_a_response_never_stored_are_dropped():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=10, max_bytes=1 << 30)
        serving.msg_store["resp_failed"] = [{"role": "user", "content": "hi"}]
        _put(serving, "resp_ok", "completed")
        await stored.forget_unstored("resp_failed")
        await stored.forget_unstored("resp_ok")
        assert set(serving.msg_store) == {"resp_ok"}

    asyncio.run(run())


def test_without_vllms_store_nothing_is_touched():
    async def run():
        serving = _serving(enabled=False)
        serving.msg_store["resp_a"] = ["kept"]
        stored = StoredResponses(serving, max_entries=1, max_bytes=1)
        await stored.forget_unstored("resp_a")
        await stored.trim()
        assert serving.msg_store == {"resp_a": ["kept"]}
        await StoredResponses(None, 1, 1).trim()  # an LM that serves no Responses

    asyncio.run(run())


async def _store(stored, serving, tenant: str, rid: str, status: str = "completed", weight: float = 1.0,
                 text: str = "x") -> None:
    """One Responses call of ``tenant`` that stored ``rid``, and the trim the servicer runs after it."""
    _put(serving, rid, status, text)
    await stored.trim(rid, tenant, weight)


def test_a_tenants_stored_response_survives_another_tenant_storing_many():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=6, max_bytes=1 << 30)
        await _store(stored, serving, "alice:", "resp_alice")
        for i in range(20):
            await _store(stored, serving, "bob:", f"resp_bob{i}")
        # Bob's new responses evicted his own oldest; alice's, within her share (half), stayed.
        assert list(serving.response_store) == ["resp_alice", *(f"resp_bob{i}" for i in range(15, 20))]
        assert "resp_alice" in serving.msg_store and stored.held("alice:") == 1 and stored.held("bob:") == 5

    asyncio.run(run())


def test_a_tenant_over_its_share_loses_its_own_oldest_to_a_newcomer_and_never_below_its_share():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=4, max_bytes=1 << 30)
        for i in range(4):  # alone, bob may hold it all
            await _store(stored, serving, "bob:", f"resp_bob{i}")
        for i in range(4):
            await _store(stored, serving, "alice:", f"resp_alice{i}")
        # Each a share of two: bob's oldest went to make room for alice, then alice's own oldest went.
        assert list(serving.response_store) == ["resp_bob2", "resp_bob3", "resp_alice2", "resp_alice3"]

    asyncio.run(run())


def test_shares_follow_the_tenants_weights():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=6, max_bytes=1 << 30)
        for i in range(8):
            await _store(stored, serving, "heavy:", f"resp_h{i}", weight=2.0)
            await _store(stored, serving, "light:", f"resp_l{i}", weight=1.0)
        assert (stored.held("heavy:"), stored.held("light:")) == (4, 2)

    asyncio.run(run())


def test_the_byte_bound_is_shared_too_so_a_few_large_responses_evict_only_their_own():
    async def run():
        serving = _serving()
        big = "y" * 10_000
        one = weigh(SimpleNamespace(status="completed", text=big)) + weigh([{"role": "user", "content": big}])
        stored = StoredResponses(serving, max_entries=100, max_bytes=int(3.5 * one))
        await _store(stored, serving, "alice:", "resp_alice", text=big)
        for i in range(6):
            await _store(stored, serving, "bob:", f"resp_bob{i}", text=big)
        assert "resp_alice" in serving.response_store and stored.nbytes <= stored.max_bytes
        assert stored.held("bob:") == 2

    asyncio.run(run())


def test_work_in_progress_counts_towards_its_tenants_share_but_is_never_forgotten():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=4, max_bytes=1 << 30)
        for i in range(3):
            await _store(stored, serving, "bob:", f"resp_busy{i}", status="in_progress")
        await _store(stored, serving, "alice:", "resp_alice")
        await _store(stored, serving, "alice:", "resp_alice2")
        # Bob is over his share with nothing ended to forget, alice within hers: the store stays over.
        assert len(serving.response_store) == 5 and stored.held("alice:") == 2
        serving.response_store["resp_busy0"].status = "completed"
        await stored.trim()
        assert "resp_busy0" not in serving.response_store and stored.held("alice:") == 2

    asyncio.run(run())


def test_a_call_that_stored_nothing_records_nothing():
    async def run():
        serving = _serving()
        stored = StoredResponses(serving, max_entries=6, max_bytes=1 << 30)
        for i in range(10):  # store: false, or a failed call: vLLM kept no response under the id
            await stored.trim(f"resp_unstored{i}", "alice:", 5.0)
        assert stored.held("alice:") == 0

    asyncio.run(run())
