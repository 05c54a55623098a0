"""Which encoders the LM may fetch from, and the compatibility handshake with
each, done once per endpoint by the LM service (outside the engine) so a
forbidden endpoint gives PERMISSION_DENIED and an incompatible encoder a clear
FAILED_PRECONDITION before the request reaches the engine. The connector
repeats the compatibility check on its own stream as a second line; it only
ever dials endpoints that passed ``PeerChecker.check``."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field

import grpc
from prometheus_client import Gauge

from ectransfer.base import ConsumerTransport
from ectransfer.peer_session import negotiate
from ectransfer.protocol import CompatError, ProtocolError
from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from peerauth import SecurityConfig
from services.common.errors import BadInput, EncoderUnavailable, Forbidden, Incompatible

PEER_TRANSPORT = Gauge("epd_lm_peer_transport", "Transport chosen per encoder (1 = in use)", ["peer", "transport"])

logger = logging.getLogger(__name__)


def _host(host: str) -> str:
    """A host in one spelling: addresses in their compressed form, names lower-case."""
    host = host.strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"transfer endpoint {endpoint!r} is not host:port")
    return _host(host), int(port)


@dataclass
class EncoderAllowList:
    """Encoder Transfer endpoints this LM may dial (``--allowed-encoders``).

    A ``Generate`` request names the endpoint each item comes from; the LM
    dials it only if this list allows it, so a caller cannot point the LM (and
    its shm probe) at a server of its choosing. Entries: ``*``, ``host:port``,
    a host or address (any port), or a CIDR. An empty list allows any endpoint
    when the LM's callers authenticate (then the authenticated gateway's word
    is trusted), and loopback addresses only otherwise.
    """

    any: bool = False
    endpoints: set[str] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    networks: list = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str, trusted_callers: bool) -> EncoderAllowList:
        entries = [e.strip() for e in spec.split(",") if e.strip()]
        if not entries:
            return cls(any=True) if trusted_callers else cls(networks=[ipaddress.ip_network("127.0.0.0/8"),
                                                                       ipaddress.ip_network("::1/128")],
                                                             hosts={"localhost"})
        out = cls()
        for e in entries:
            if e == "*":
                out.any = True
            elif "/" in e:
                try:
                    out.networks.append(ipaddress.ip_network(e, strict=False))
                except ValueError:
                    raise ValueError(f"allowed_encoders: {e!r} is not a CIDR") from None
            elif e.count(":") == 1 or (e.startswith("[") and "]:" in e):
                try:
                    host, port = _split(e)
                except BadInput:
                    raise ValueError(f"allowed_encoders: {e!r} is not host:port") from None
                out.endpoints.add(f"{host}:{port}")
            else:  # a name, or an address (IPv6 ones have several colons)
                out.hosts.add(_host(e))
        return out

    def allows(self, endpoint: str) -> bool:
        host, port = _split(endpoint)
        if self.any or f"{host}:{port}" in self.endpoints or host in self.hosts:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)


class PeerChecker:
    def __init__(self, compat: transfer_pb2.CompatInfo, consumer_id: str, transports: list[ConsumerTransport],
                 timeout_s: float, security: SecurityConfig | None = None,
                 allowed: EncoderAllowList | None = None):
        self.compat = compat
        self.consumer_id = consumer_id
        self.transports = transports
        self.timeout_s = timeout_s
        self.security = security or SecurityConfig()
        self.allowed = allowed or EncoderAllowList.parse("", trusted_callers=False)
        self.transport: dict[str, str] = {}
        """Transport negotiated per encoder endpoint that passed the check (its keys are the checked ones)."""
        self._locks: dict[str, asyncio.Lock] = {}

    async def check(self, endpoint: str) -> None:
        """Raises Forbidden for an endpoint outside the allow-list, Incompatible or
        EncoderUnavailable when the handshake fails; passes once per endpoint."""
        if endpoint in self.transport:
            return
        if not self.allowed.allows(endpoint):
            raise Forbidden(f"encoder transfer endpoint {endpoint!r} is not in this LM's allowed encoders "
                            f"(--allowed-encoders)")
        async with self._locks.setdefault(endpoint, asyncio.Lock()):
            if endpoint not in self.transport:
                self.transport[endpoint] = await self._handshake(endpoint)

    def forget(self, endpoint: str) -> None:
        self.transport.pop(endpoint, None)

    async def _handshake(self, endpoint: str) -> str:
        """The connector's handshake, from this process (same host, same /dev/shm
        view as the engine): compatibility and transport choice."""
        out: asyncio.Queue = asyncio.Queue()
        hello = transfer_pb2.TransferClientMsg(hello=transfer_pb2.Hello(
            compat=self.compat, consumer_id=self.consumer_id, transports=[t.kind for t in self.transports]))

        async def requests():
            yield hello
            while (msg := await out.get()) is not None:
                yield msg

        async with self.security.aio_channel(endpoint) as ch:
            call = transfer_pb2_grpc.TransferServiceStub(ch).Transfer(requests(), timeout=self.timeout_s)
            try:
                choice = await negotiate(call, out.put_nowait, self.compat, self.transports,
                                         select=lambda c: not c.transport.provisional, channel=ch)
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
