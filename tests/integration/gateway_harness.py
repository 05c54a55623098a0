"""The whole gateway (``server.serve``: REST, native gRPC, instance pools) in process on loopback, driven
over HTTP (aiohttp) and gRPC, for the tests that run it against the fakes of ``gateway_fakes``.

Ports: HTTP binds port 0 and reports the port it got (``on_listening``); the gRPC API's port 0 means
"disabled", so it gets one from ``services.up.free_port`` (below the kernel's ephemeral range: nothing that
binds port 0 or dials out can take it between the choice and the bind)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from peerauth import SecurityConfig
from services.gateway.config import GatewayConfig
from services.gateway.server import serve
from services.up import free_port


def chat(text: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


class Gateway:
    """``serve()`` on loopback, driven over HTTP (aiohttp) and gRPC. ``security``: what the gateway presents
    to encoders and LMs."""

    def __init__(self, security: SecurityConfig | None = None, **cfg) -> None:
        # HTTP on port 0 (the port bound is reported); gRPC's port 0 means "off", so a free one (see above).
        # encode_timeout_s: past what a healthy fake encode takes even on a slow, busy host.
        defaults = dict(port=0, grpc_port=free_port(), health_interval_s=0.1, epd_facts=True,
                        encode_timeout_s=10.0, request_timeout_s=20.0)
        self.cfg = GatewayConfig(**{**defaults, **cfg})
        self.security = security
        self.url = ""
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.http: aiohttp.ClientSession | None = None
        self.channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> Gateway:
        listening: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve(self.cfg, self.stop, self.security,
                                              on_listening=lambda *ports: listening.set_result(ports)))
        done, _ = await asyncio.wait([listening, self.task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if listening not in done:
            self.task.cancel()
            if self.task in done:
                self.task.result()  # the gateway failed to start: raise its error
            raise AssertionError("the gateway did not listen within 30s")
        http_port, grpc_port = listening.result()
        self.url = f"http://127.0.0.1:{http_port}"
        self.http = aiohttp.ClientSession()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        if self.channel is not None:
            await self.channel.close()
        if self.http is not None:
            await self.http.close()
        await asyncio.wait_for(self.task, 10)

    def connection(self) -> grpc.aio.Channel:
        """A gRPC channel to the gateway on a connection of its own, as another client's would be (channels to
        one target share a connection unless told not to); the caller closes it."""
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.cfg.grpc_port}",
                                         options=[("grpc.use_local_subchannel_pool", 1)])

    async def get(self, path: str) -> tuple[int, dict]:
        try:
            async with self.http.get(self.url + path) as r:
                return r.status, await r.json()
        except aiohttp.ClientConnectionError:
            if self.task.done():
                self.task.result()  # the gateway failed: raise its error
            return 0, {}

    async def post(self, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict, Any]:
        """Status, JSON body (an event stream as ``{"sse": text}``) and the headers (case-insensitive)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(self.url + path, data=data, headers=headers or {}) as r:
            text = await r.text()
            return r.status, (json.loads(text) if r.content_type == "application/json" else {"sse": text}), \
                r.headers.copy()

    async def grpc_chat(self, text: str = "hi", request_id: str = "") -> list[gateway_pb2.OpenAIResponse]:
        """A streaming chat over the gRPC API: every message (chunks, then the one with ``epd``)."""
        stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        req = gateway_pb2.OpenAIRequest(body=json.dumps(chat(text, stream=True)).encode(), request_id=request_id)
        return [c async for c in stub.ChatCompletion(req, timeout=10)]

    @staticmethod
    async def poll(fetch, done, timeout: float, what: str):
        """``await fetch()`` until ``done(result)``; AssertionError with the last result after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            result = await fetch()
            if done(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout}s: {what} (last: {result})")
            await asyncio.sleep(0.05)


async def metric(gw: Gateway, name: str, **labels) -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    async with gw.http.get(gw.url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
