"""Decodes stop when their request does: DecodeThreads raises DecodeCancelled in the job's own
thread when the caller is cancelled or the deadline passes, and the thread really ends."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.common.errors import BadInput
from services.common.interruptible import DecodeThreads
from services.common.media import MediaConfig, MediaDecoder

pytestmark = pytest.mark.unit


def _spinner(started: threading.Event, ended: threading.Event, steps: list[int]):
    """A job that would run for a minute, a Python instruction at a time (as a frame loop does)."""

    def job():
        started.set()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                steps.append(1)
                time.sleep(0.001)
        finally:
            ended.set()
        return "finished"

    return job


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(10), what


def test_a_cancelled_caller_stops_its_job_thread_and_gives_its_slot_back():
    threads, started, ended, steps = DecodeThreads(1), threading.Event(), threading.Event(), []

    async def main():
        task = asyncio.ensure_future(threads.run(_spinner(started, ended, steps)))
        await asyncio.to_thread(_wait, started, "the job started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(_wait, ended, "the job's thread stopped")
        n = len(steps)
        await asyncio.sleep(0.05)
        assert len(steps) == n  # nothing runs any more
        assert await threads.run(lambda: 7) == 7  # the one slot is free again
        assert threads.running == 0

    asyncio.run(main())


def test_a_job_past_its_deadline_is_stopped_and_the_caller_gets_a_timeout():
    threads, started, ended = DecodeThreads(2), threading.Event(), threading.Event()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await threads.run(_spinner(started, ended, []), timeout_s=0.2)
        await asyncio.to_thread(_wait, ended, "the job's thread stopped")

    asyncio.run(main())


def test_a_job_error_reaches_the_caller_and_a_result_comes_back():
    threads = DecodeThreads(2)

    async def main():
        assert await threads.run(lambda: "ok") == "ok"
        with pytest.raises(ValueError, match="bad bytes"):
            await threads.run(lambda: (_ for _ in ()).throw(ValueError("bad bytes")))

    asyncio.run(main())


def test_at_most_n_jobs_run_at_once():
    threads, lock, now, peak = DecodeThreads(2), threading.Lock(), [0], [0]

    def job():
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        # Hold the slot until a second job runs beside it (a busy host may start the second thread later
        # than a fixed sleep lasts), then a little longer, room for a third were it allowed.
        deadline = time.monotonic() + 10
        while peak[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        with lock:
            now[0] -= 1

    async def main():
        await asyncio.gather(*(threads.run(job) for _ in range(6)))

    asyncio.run(main())
    assert peak[0] == 2


def test_a_video_decode_past_the_decode_timeout_is_stopped_and_refused(monkeypatch):
    """The decoder's deadline (--decode-timeout-s) on a real vLLM-style frame loop: the request
    gets a clear BadInput and its budget back at once."""
    from tools.media import make_video

    dec = MediaDecoder(MediaConfig(decode_timeout_s=0.3))
    started, ended = threading.Event(), threading.Event()

    def slow_loader(data: bytes):
        return _spinner(started, ended, [])()

    async def main():
        with pytest.raises(BadInput, match="decode-timeout-s"):
            await dec.decode_media("video", [make_video()], 2, slow_loader)
        assert dec.budget.used == 0
        await asyncio.to_thread(_wait, ended, "the decode thread stopped")

    asyncio.run(main())
