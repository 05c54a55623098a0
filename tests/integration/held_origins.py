"""Two local origins for the fetch tests that share the fetcher's pool: aiohttp on 127.0.0.1, two
ports, on the test's own event loop. Used by tests/integration/test_fetch.py.

Paths: /hold (an image, once ``release`` is set: an origin that holds its connections),
/good.png (an image at once). ``in_flight`` and ``most`` count the /hold requests being served at
once, per port.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from tools.media import make_image


class HeldOrigins:
    """Two origins (127.0.0.1 on two ports) on the test's own loop. ``/hold`` answers only once
    ``release`` is set; ``/good.png`` at once. ``in_flight``/``most`` count the requests being served
    at once, per port: one connection each, since a connection serves one request at a time."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.in_flight: dict[int, int] = {}
        self.most: dict[int, int] = {}
        self.ports: list[int] = []

    async def start(self) -> HeldOrigins:
        app = web.Application()
        app.router.add_get("/hold", self._hold)
        app.router.add_get("/good.png", lambda r: web.Response(body=make_image(0), content_type="image/png"))
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        for _ in range(2):
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.ports = [a[1] for a in self._runner.addresses]
        return self

    def url(self, origin: int, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[origin]}{path}"

    async def _hold(self, request: web.Request) -> web.Response:
        port = request.transport.get_extra_info("sockname")[1]
        self.in_flight[port] = self.in_flight.get(port, 0) + 1
        self.most[port] = max(self.most.get(port, 0), self.in_flight[port])
        try:
            await self.release.wait()
            return web.Response(body=make_image(0), content_type="image/png")
        finally:
            self.in_flight[port] -= 1

    async def until_held(self, origin: int, n: int) -> None:
        while self.in_flight.get(self.ports[origin], 0) < n:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.release.set()
        await self._runner.cleanup()
