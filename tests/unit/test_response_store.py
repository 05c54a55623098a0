"""The LM's bound on vLLM's stored Responses (services/lm/response_store.py): the oldest ended responses
are forgotten past --responses-store-max / --responses-store-mib, work in progress never is, and input
messages of a response vLLM never stored are dropped. The store's names are checked in vLLM's source."""

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
