"""Large bodies parsed in the gateway's helper process (services.gateway.parse_pool), a real spawned
process each: the helper decides exactly what the inline parse decides (the same OpenAICall, the same
ApiError), a helper killed mid-parse answers its body 503 and the next body is parsed by a new one,
and a closed pool leaves no process and no body file behind."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal

import psutil
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.parse_pool import BODY_FILE_PREFIX, HELPER_GONE, ParsePool
from services.gateway.request import parse_openai
from tests.unit.helpers import data_url, image_bytes

pytestmark = pytest.mark.integration

CFG = GatewayConfig(lms="lm:1", max_images=2)
THRESHOLD = 1 << 10  # small bodies here are "large": the tests stay fast


def _chat(*content, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": list(content)}], **extra}).encode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BIG_IMAGE = data_url(image_bytes("PNG", (256, 256), noise=True))
GOOD = [
    ("chat", _chat({"type": "text", "text": "x" * 4096}, _image(BIG_IMAGE), _image(BIG_IMAGE), stream=True), None),
    ("chat", _chat({"type": "text", "text": "two raw items" * 100}, _image("epd-media:1"), _image("epd-media:0")),
     [b"first" * 400, b"second" * 400]),
    ("completions", json.dumps({"model": "m", "prompt": "p" * 4096}).encode(), None),
]
BAD = [
    b"{" + b" " * 2048,  # not JSON
    b'{"x": NaN' + b" " * 2048 + b"}",  # a literal RFC 8259 has not
    b"[" + b"1," * 2048 + b"1]",  # not an object
    b"[" * 5000 + b"]" * 5000,  # nested past the recursion limit
    _chat(_image(BIG_IMAGE), _image(BIG_IMAGE), _image(BIG_IMAGE)),  # over --max-images
    _chat({"type": "text", "text": "y" * 2048}, _image("epd-media:7")),  # names no media item
]


def _owned_body_files(pool: ParsePool) -> list[str]:
    return [n for n in os.listdir(pool.body_dir) if n.startswith(f"{BODY_FILE_PREFIX}{os.getpid()}-")]


def _inline_error(api: str, raw: bytes, media) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_openai(api, raw, CFG, media)
    return e.value


def test_an_api_error_pickles_whole():
    e = pickle.loads(pickle.dumps(ApiError(429, "slow down", "rate_limit_error", "messages", "3")))
    assert (e.status, e.message, e.type, e.param, e.retry_after, str(e)) == (
        429, "slow down", "rate_limit_error", "messages", "3", "slow down")


def test_the_helper_decides_what_the_inline_parse_decides_and_leaves_nothing_behind():
    async def main():
        pool = ParsePool(CFG, THRESHOLD)
        await pool.start()
        helper = psutil.Process(pool.helper_pid)
        assert helper.nice() >= psutil.Process().nice() + 10
        try:
            for api, raw, media in GOOD:
                assert pool.wants(api, raw)
                assert await pool.parse(api, raw, media) == parse_openai(api, raw, CFG, media)
            for raw in BAD:
                media = [b"only one"]
                with pytest.raises(ApiError) as e:
                    await pool.parse("chat", raw, media)
                want = _inline_error("chat", raw, media)
                assert (e.value.status, e.value.message, e.value.type, e.value.param) == (
                    want.status, want.message, want.type, want.param)
            assert not pool.wants("chat", b"{}") and not pool.wants("transcriptions", b"x" * THRESHOLD)
        finally:
            await pool.close()
        assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE
        assert _owned_body_files(pool) == [] and pool._held == {}  # every file and its lock given up
        assert not pool.wants("chat", GOOD[0][1])  # closed: bodies are parsed inline again

    asyncio.run(main())


async def _parse_until_killed(pool: ParsePool, raw: bytes) -> ApiError:
    """Kills the helper once it has read ``raw``'s file (it is then parsing); returns what ``parse`` raised."""
    task = asyncio.ensure_future(pool.parse("chat", raw))
    while not _owned_body_files(pool):  # written...
        await asyncio.sleep(0.001)
    while _owned_body_files(pool):  # ...and read by the helper
        await asyncio.sleep(0.001)
    os.kill(pool.helper_pid, signal.SIGKILL)
    with pytest.raises(ApiError) as e:
        await task
    return e.value


def test_a_helper_killed_mid_parse_answers_503_and_a_new_one_parses_the_next_body():
    # Millions of numbers: a parse that takes long enough to be killed in the middle of it.
    slow = _chat({"type": "text", "text": "x"}, numbers=[0] * 3_000_000)
    api, raw, media = GOOD[0]

    async def main():
        pool = ParsePool(CFG, THRESHOLD)
        await pool.start()
        first = pool.helper_pid
        try:
            e = await _parse_until_killed(pool, slow)
            assert (e.status, e.type, e.message, e.retry_after) == (503, "server_error", HELPER_GONE, "1")
            assert await asyncio.wait_for(pool.parse(api, raw, media), 30) == parse_openai(api, raw, CFG, media)
            assert pool.helper_pid != first and not psutil.pid_exists(first) or \
                psutil.Process(first).status() == psutil.STATUS_ZOMBIE
            second = psutil.Process(pool.helper_pid)
        finally:
            await pool.close()
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE
        assert _owned_body_files(pool) == []

    asyncio.run(main())


_HOLD_AND_WAIT = """
import os, sys, time
from ectransfer.lockfile import create_held
path = os.path.join(sys.argv[1], f"{sys.argv[2]}{os.getpid()}-{os.urandom(8).hex()}")
create_held(path)
print(path, flush=True)
time.sleep(600)
"""


def test_body_files_a_killed_gateway_left_are_removed_when_a_helper_starts_and_live_ones_kept():
    """A gateway process killed with ``kill -9`` mid-parse leaves its body file; the lock it held goes with
    it, so the next parse helper's start removes the file, and leaves one a live process holds."""
    import subprocess
    import sys

    body_dir = ParsePool(CFG, THRESHOLD).body_dir
    holders = [subprocess.Popen([sys.executable, "-c", _HOLD_AND_WAIT, body_dir, BODY_FILE_PREFIX], stdout=subprocess.PIPE,
                                text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))) for _ in range(2)]
    paths = []
    try:
        paths = [h.stdout.readline().strip() for h in holders]
        assert all(os.path.exists(p) for p in paths), paths
        holders[0].kill()  # kill -9: its lock goes, its file stays
        holders[0].wait()

        async def main():
            pool = ParsePool(CFG, THRESHOLD)
            await pool.start()
            await pool.close()

        asyncio.run(main())
        assert not os.path.exists(paths[0])
        assert os.path.exists(paths[1])  # its owner lives
    finally:
        for h in holders:
            h.kill()
            h.wait()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
