"""A local image server for the fetch tests: aiohttp on 127.0.0.1, port 0, in its own thread and
event loop, so a fetch from the test's loop (or from a gateway subprocess) meets a real server.
Used by tests/integration/test_fetch.py and tests/e2e/test_media_fetch.py.

Paths: /good.png (make_image(0)), /big (50 MB with Content-Length), /chunked (50 MB, chunked, no
Content-Length), /text (text/html), /bomb.png (bomb_png()), /status/<code>, /redirect/<n> (n redirects,
the last to /good.png), /to/<url-quoted target> (one redirect there), /slow (headers after 60 s),
/trickle (image headers, then a byte every 0.2 s). ``hits`` counts requests per path;
``sent`` counts body bytes written per path.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import urllib.parse

from aiohttp import web

from tools.media import bomb_png, make_audio, make_image

BIG = 50 << 20
_CHUNK = bytes(1 << 20)


class MediaServer:
    def __init__(self) -> None:
        self.hits: collections.Counter[str] = collections.Counter()
        self.sent: collections.Counter[str] = collections.Counter()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="media-server", daemon=True)
        self._runner: web.AppRunner | None = None

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def start(self) -> MediaServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/good.png", lambda r: web.Response(body=make_image(0), content_type="image/png"))
        app.router.add_get("/bomb.png", lambda r: web.Response(body=bomb_png(), content_type="image/png"))
        app.router.add_get("/clip.wav", lambda r: web.Response(body=make_audio(0, 0.5), content_type="audio/wav"))
        app.router.add_get("/text", lambda r: web.Response(text="<html></html>", content_type="text/html"))
        app.router.add_get("/status/{code}", lambda r: web.Response(status=int(r.match_info["code"])))
        app.router.add_get("/redirect/{n}", self._redirect)
        app.router.add_get("/to/{target:.+}", self._to)
        app.router.add_get("/big", lambda r: self._stream(r, BIG, length=True))
        app.router.add_get("/chunked", lambda r: self._stream(r, BIG, length=False))
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/trickle", self._trickle)
        # handler_cancellation: a fetch that gives up ends the handler (no 60 s sleeps left over).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.hits[request.path] += 1
        return await handler(request)

    async def _redirect(self, request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        raise web.HTTPFound(f"/redirect/{n - 1}" if n > 1 else "/good.png")

    async def _to(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(urllib.parse.unquote(request.match_info["target"]))

    async def _stream(self, request: web.Request, size: int, length: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        if length:
            resp.content_length = size
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        written = 0
        try:
            while written < size:
                await resp.write(_CHUNK)
                written += len(_CHUNK)
                self.sent[request.path] += len(_CHUNK)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client gave up, as it should
        return resp

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response(body=make_image(0), content_type="image/png")

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        for b in make_image(0):
            await resp.write(bytes([b]))
            await asyncio.sleep(0.2)
        return resp
