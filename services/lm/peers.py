"""Compatibility handshakes with encoder endpoints, done once per endpoint by
the LM service (outside the engine) so an incompatible encoder gives the
client a clear FAILED_PRECONDITION before the request reaches the engine.
The connector repeats the check on its own stream as a second line."""

from __future__ import annotations

import asyncio
import logging

import grpc

from prometheus_client import Gauge

from ectransfer.base import ConsumerTransport
from ectransfer.client import negotiate
from ectransfer.protocol import CompatError, ProtocolError
from epd.common.v1 import common_pb2
from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from services.common.errors import EncoderUnavailable, Incompatible

PEER_TRANSPORT = Gauge("epd_lm_peer_transport", "Transport chosen per encoder (1 = in use)", ["peer", "transport"])

logger = logging.getLogger(__name__)


class OfferedCudaIpc(ConsumerTransport):
    """CUDA IPC as the LM *service* process sees it: usable when offered and
    this host has CUDA and cupy. It never opens the handle (no CUDA context in
    the service process), so the handshake stops before Select; the engine's
    connector proves it for real."""

    kind = common_pb2.CUDA_IPC

    def probe(self, offer: encoder_pb2.TransportOffer) -> bytes:
        from ectransfer.factory import cuda_ipc_usable

        if not cuda_ipc_usable():
            raise ProtocolError("no CUDA device or no cupy in this process")
        return b""

    def receiver(self, desc, dest):
        raise ProtocolError("the LM service never receives items itself")


class PeerChecker:
    def __init__(self, compat: common_pb2.CompatInfo, consumer_id: str, transports: list[ConsumerTransport],
                 timeout_s: float):
        self.compat = compat
        self.consumer_id = consumer_id
        self.transports = transports
        self.timeout_s = timeout_s
        self.transport: dict[str, str] = {}
        """Transport negotiated per encoder endpoint that passed the check (its keys are the checked ones)."""
        self._locks: dict[str, asyncio.Lock] = {}

    async def check(self, endpoint: str) -> None:
        if endpoint in self.transport:
            return
        async with self._locks.setdefault(endpoint, asyncio.Lock()):
            if endpoint not in self.transport:
                self.transport[endpoint] = await self._handshake(endpoint)

    def forget(self, endpoint: str) -> None:
        self.transport.pop(endpoint, None)

    async def _handshake(self, endpoint: str) -> str:
        """The connector's handshake, from this process (same host, same /dev/shm
        view as the engine): compatibility and transport choice."""
        out: asyncio.Queue = asyncio.Queue()
        hello = encoder_pb2.TransferClientMsg(hello=encoder_pb2.Hello(
            compat=self.compat, consumer_id=self.consumer_id, transports=[t.kind for t in self.transports]))

        async def requests():
            yield hello
            while (msg := await out.get()) is not None:
                yield msg

        async with grpc.aio.insecure_channel(endpoint) as ch:
            call = encoder_pb2_grpc.TransferServiceStub(ch).Transfer(requests(), timeout=self.timeout_s)
            try:
                choice = await negotiate(call, out.put_nowait, self.compat, self.transports,
                                         select=lambda c: not isinstance(c.transport, OfferedCudaIpc))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise Incompatible(e.details()) from None
                raise EncoderUnavailable(f"encoder at {endpoint}: {e.code().name}: {e.details()}", [endpoint]) from None
            except (CompatError, ProtocolError) as e:
                raise Incompatible(f"encoder at {endpoint}: {e}") from None
            finally:
                out.put_nowait(None)
                call.cancel()
        PEER_TRANSPORT.labels(endpoint, choice.name).set(1)
        if choice.fell_back:
            logger.warning("encoder %s: transfers use %s (%s)", endpoint, choice.name, "; ".join(choice.skipped))
        return choice.name
