"""Compatibility handshakes with encoder endpoints, done once per endpoint by
the LM service (outside the engine) so an incompatible encoder gives the
client a clear FAILED_PRECONDITION before the request reaches the engine.
The connector repeats the check on its own stream as a second line."""

from __future__ import annotations

import asyncio
import logging

import grpc

from epd.common.v1 import common_pb2
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from services.common.errors import Incompatible, PeerUnavailable

logger = logging.getLogger(__name__)


class PeerChecker:
    def __init__(self, compat: common_pb2.CompatInfo, consumer_id: str, transports: list[int], timeout_s: float):
        self.compat = compat
        self.consumer_id = consumer_id
        self.transports = transports
        self.timeout_s = timeout_s
        self._ok: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    async def check(self, endpoint: str) -> None:
        if endpoint in self._ok:
            return
        async with self._locks.setdefault(endpoint, asyncio.Lock()):
            if endpoint in self._ok:
                return
            await self._handshake(endpoint)
            self._ok.add(endpoint)

    def forget(self, endpoint: str) -> None:
        self._ok.discard(endpoint)

    async def _handshake(self, endpoint: str) -> None:
        hello = encoder_pb2.TransferClientMsg(hello=encoder_pb2.Hello(
            compat=self.compat, consumer_id=self.consumer_id, transports=self.transports))

        async def requests():
            yield hello

        async with grpc.aio.insecure_channel(endpoint) as ch:
            call = encoder_pb2_grpc.TransferServiceStub(ch).Transfer(requests(), timeout=self.timeout_s)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise Incompatible(e.details()) from None
                raise PeerUnavailable(f"encoder at {endpoint}: {e.code().name}: {e.details()}") from None
