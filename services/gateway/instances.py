"""The gateway's view of its encoder and LM instances: addresses (static or
from DNS), one gRPC channel each, in-flight load, and health.

``InstancePool`` is owned by the ``Orchestrator`` (one per role) and runs one
background task that, every ``health_interval_s``, re-resolves host names
(every ``dns_refresh_s``) and checks each instance with ``grpc.health.v1``
(readiness of the role's service). An instance starts ``PENDING`` and is routed
to only once admitted: its check passed and the pool's ``verify`` hook
accepted it (the orchestrator's call ``GetInfo``, which, unlike the health
check, needs the gateway's credentials; the LM pool's also checks the model), so
peers may start in any order and one that would refuse every call is never
routed to. A failed check, or a request that found the instance unreachable
(or refused by it), ejects it; the next passing check (and ``verify``) re-admits it. An admitted
instance that answers NOT_SERVING is draining (it was told to leave: services/common/drain.py): no new
work is routed to it while another instance can take it, and the calls it has go on. Entries come from the
command line or, with ``--fleet-file``, from that file (``entries_source``), so instances join and leave
while the gateway runs. The states and their transitions are ``InstanceState`` and ``TRANSITIONS``
(``instance_state.py``). Routing reads ``healthy()`` and each instance's ``outstanding`` count; the orchestrator
holds ``track()`` around every call so the count stays exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from epd.encoder.v1 import encoder_pb2
from epd.lm.v1 import lm_pb2
from peerauth import SecurityConfig
from services.common.grpc_server import GRPC_OPTIONS
from services.gateway.instance_state import ON_FAILURE, ON_NOT_SERVING, TRANSITIONS, InstanceState

logger = logging.getLogger(__name__)

# With --workers (services.gateway.metrics): the calls of every worker, and 1 only while every worker admits it.
OUTSTANDING = Gauge("epd_gateway_instance_outstanding", "Calls in flight per instance", ["role", "instance"],
                    multiprocess_mode="livesum")
HEALTHY = Gauge("epd_gateway_instance_healthy", "1 while the instance is admitted, 0 while ejected",
                ["role", "instance"], multiprocess_mode="livemin")
CALLS = Counter("epd_gateway_instance_calls_total", "Calls sent to each instance", ["role", "instance"])
EJECTIONS = Counter("epd_gateway_instance_ejections_total", "Times an instance was ejected", ["role", "instance"])

_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
              ("grpc.max_reconnect_backoff_ms", 2000),
              # A peer that vanished without closing (a cut link, a frozen host) is noticed within
              # 15 s by a ping, not after TCP's retransmit backoff.
              ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]

# The readiness name each role's server registers with grpc.health.v1 (from the protos, as the servers do).
SERVICE_NAMES = {"encoder": encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
                 "lm": lm_pb2.DESCRIPTOR.services_by_name["LMService"].full_name}




@dataclass(eq=False)
class Instance:
    """One encoder or LM process, dialed at ``address`` (``ip:port``)."""

    role: str
    address: str
    source: str
    """The configured entry it came from (the address itself, or a host name)."""
    stub: Any
    channel: grpc.aio.Channel
    state: InstanceState = InstanceState.PENDING
    outstanding: int = 0
    slow_since: float | None = None
    """Start of the first health check of the current run of timed-out ones."""
    reason: str = ""
    """Why it is not admitted (for logs, /health and errors); empty while admitted."""
    lm_role: str = "both"
    """An LM's role, from its GetInfo: "both", "prefill" or "decode" (E -> P -> D)."""
    speech_windows: bool = False
    """An encoder's, from its GetInfo: it cuts speech-to-text uploads into windows (an encoder-decoder model)."""

    def __post_init__(self) -> None:
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._calls = CALLS.labels(self.role, self.address)  # the children, looked up once
        self._outstanding = OUTSTANDING.labels(self.role, self.address)

    @property
    def healthy(self) -> bool:
        """Admitted: requests may be routed to it."""
        return self.state is InstanceState.ADMITTED

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Counts one call in flight for load-aware routing."""
        self.outstanding += 1
        self._calls.inc()
        self._outstanding.set(self.outstanding)
        try:
            yield
        finally:
            self.outstanding -= 1
            self._outstanding.set(self.outstanding)

    def forget_metrics(self) -> None:
        """Drops this address's metric children (it left DNS: pod IPs come and go). With workers the
        merged page keeps a dropped series at its last value (prometheus_client's files): 0, ejected."""
        HEALTHY.labels(self.role, self.address).set(0)
        for metric in (OUTSTANDING, HEALTHY, CALLS, EJECTIONS):
            with contextlib.suppress(KeyError):
                metric.remove(self.role, self.address)


def split_host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"instance address {entry!r} is not host:port")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every TCP address a host name resolves to, as ``ip:port`` strings."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


@dataclass
class InstancePool:
    """The instances of one role. ``entries`` are the configured ``host:port``
    strings; IP literals are one instance each, host names one per address."""

    role: str
    entries: list[str]
    stub_cls: Callable[[grpc.aio.Channel], Any]
    health_interval_s: float = 1.0
    dns_refresh_s: float = 10.0
    resolver: Callable[[str, int], Any] = resolve
    verify: Callable[[Instance], Awaitable[str | None]] | None = None
    """Called by ``check`` with an instance that passed its health check but is not admitted; returns why
    it may not be admitted (None: admit it). Runs on the pool's event loop; must not raise."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS and token for the channels to these instances."""
    watch: Callable[[Instance], Awaitable[None]] | None = None
    """Called by ``check`` after an admitted instance passed its health check (the fleet reads an LM's
    holdings then); runs on the pool's event loop; must not raise."""
    removed: Callable[[str], None] | None = None
    """Called with an instance's address when it leaves the pool (no longer in DNS or the fleet file)."""
    entries_source: Callable[[], list[str] | None] | None = None
    """The entries now (``--fleet-file``'s, ``services.gateway.fleet_file``), read at the start of each health
    round; None from it keeps the current ones. The pool's entries follow it (``set_entries``)."""
    instances: dict[str, Instance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # channels of removed instances, closed when idle
        self._checks: set[asyncio.Task] = set()  # checks of instances a call just failed on
        self._resolved_at = 0.0
        for entry in self.entries:
            host, _ = split_host_port(entry)
            if is_ip(host):
                self._add(entry, entry)

    def _add(self, address: str, source: str) -> None:
        if address in self.instances:
            return
        # Short reconnect backoff: a restarted instance is re-admitted within seconds,
        # not after grpc's default backoff of up to two minutes.
        channel = self.security.aio_channel(address, options=[*GRPC_OPTIONS, *_RECONNECT])
        self.instances[address] = Instance(self.role, address, source, self.stub_cls(channel), channel,
                                           reason="not checked yet")
        HEALTHY.labels(self.role, address).set(0)  # routed to once a check admits it

    def _remove(self, address: str, why: str = "") -> None:
        inst = self.instances.pop(address)
        if self.removed is not None:
            self.removed(address)
        logger.info("%s %s removed (%s)", self.role, address, why or f"no longer in DNS for {inst.source}")
        # Calls in flight keep their channel; close it once they are done. The pool
        # holds the task (the loop keeps only weak references) and close() ends it.
        task = asyncio.get_running_loop().create_task(self._close_when_idle(inst))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_when_idle(inst: Instance) -> None:
        try:
            while inst.outstanding:
                await asyncio.sleep(1)
        finally:
            inst.forget_metrics()
            await inst.channel.close()

    async def refresh_dns(self) -> None:
        """Re-resolves the host-name entries; an entry that does not resolve
        keeps its previous instances (or, never resolved, is dialed by name)."""
        self._resolved_at = time.monotonic()
        for entry in self.entries:
            host, port = split_host_port(entry)
            if is_ip(host):
                continue
            try:
                addresses = set(await self.resolver(host, port))
            except OSError as e:
                logger.warning("%s %s: DNS lookup failed (%s); keeping the current instances", self.role, entry, e)
                if not any(i.source == entry for i in self.instances.values()):
                    self._add(entry, entry)
                continue
            current = {a for a, i in self.instances.items() if i.source == entry}
            for address in sorted(addresses - current):
                logger.info("%s %s: new instance %s", self.role, entry, address)
                self._add(address, entry)
            for address in sorted(current - addresses):
                self._remove(address)

    def set_entries(self, entries: list[str]) -> None:
        """Makes ``entries`` the pool's configured entries: instances of an entry that is gone leave (calls in
        flight keep their channel until done), IP literals that are new are added (checked in this round),
        host names are resolved in this round. Raises ValueError for an entry that is not host:port (the
        entries are then unchanged). Runs on the pool's event loop."""
        for entry in entries:
            split_host_port(entry)
        wanted = set(entries)
        for address, inst in list(self.instances.items()):
            if inst.source not in wanted:
                self._remove(address, f"{inst.source} left the fleet")
        self.entries = list(entries)
        for entry in self.entries:
            host, _ = split_host_port(entry)
            if is_ip(host) and entry not in self.instances:
                logger.info("%s %s joined the fleet", self.role, entry)
                self._add(entry, entry)
        self._resolved_at = 0.0  # host names: resolved in this round

    def _follow_source(self) -> None:
        if self.entries_source is None:
            return
        entries = self.entries_source()
        if entries is None or entries == self.entries:
            return
        try:
            self.set_entries(entries)
        except ValueError as e:
            logger.warning("%s: the fleet's entries are not usable (%s); keeping the current ones", self.role, e)

    def healthy(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        return [i for i in self.instances.values() if i.healthy and i.address not in exclude]

    def ejected(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        """Instances that were admitted and are out now (never the pending, refused or draining ones)."""
        return [i for i in self.instances.values() if i.state is InstanceState.EJECTED and i.address not in exclude]

    def draining(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        """Instances that are leaving (they answer NOT_SERVING) and still reachable for what they hold."""
        return [i for i in self.instances.values() if i.state is InstanceState.DRAINING and i.address not in exclude]

    def _move(self, inst: Instance, state: InstanceState, reason: str) -> None:
        if state not in TRANSITIONS[inst.state]:
            raise AssertionError(f"{self.role} {inst.address}: no transition {inst.state.name} -> {state.name}")
        before, changed = inst.state, (inst.state, inst.reason) != (state, reason)
        inst.state, inst.reason = state, reason
        HEALTHY.labels(self.role, inst.address).set(1 if state is InstanceState.ADMITTED else 0)
        if not changed:
            return  # logged when it started
        if state is InstanceState.EJECTED and before is InstanceState.ADMITTED:
            logger.warning("%s %s ejected: %s", self.role, inst.address, reason)
            EJECTIONS.labels(self.role, inst.address).inc()
        elif state is InstanceState.ADMITTED:
            logger.info("%s %s %s (health check passed)", self.role, inst.address,
                        "admitted" if before is InstanceState.PENDING else "re-admitted")
        elif state is InstanceState.REFUSED:
            logger.warning("%s %s refused: %s", self.role, inst.address, reason)
        elif state is InstanceState.PENDING:
            logger.info("%s %s not ready yet: %s", self.role, inst.address, reason)
        elif state is InstanceState.DRAINING:
            logger.info("%s %s draining: no new work routed to it (%s)", self.role, inst.address, reason)

    def drain(self, inst: Instance, reason: str) -> None:
        """A NOT_SERVING answer: an admitted (or ejected) instance is draining; any other stays as it is."""
        self._move(inst, ON_NOT_SERVING.get(inst.state, inst.state), reason)

    def eject(self, inst: Instance, reason: str) -> None:
        """A failed check or call: an admitted instance is ejected; a pending or refused one stays so."""
        self._move(inst, ON_FAILURE.get(inst.state, inst.state), reason)

    def admit(self, inst: Instance) -> None:
        """Routes requests to ``inst`` from now on (``check`` calls it after a passing check and ``verify``)."""
        self._move(inst, InstanceState.ADMITTED, "")

    def refuse(self, inst: Instance, reason: str) -> None:
        """``verify`` refused ``inst``: it answers but must not be routed to."""
        self._move(inst, InstanceState.REFUSED, reason)

    async def check(self, inst: Instance) -> None:
        """One readiness check; ejects or re-admits the instance."""
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAMES.get(self.role, ""))
        timeout = max(1.0, self.health_interval_s)
        started = time.monotonic()
        try:
            resp = await inst.health.Check(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # unreachable: out now
                self.eject(inst, f"health check failed: {e.code().name}")
                return
            # Slow: out once it has not answered for two timeouts in a row, so one busy
            # moment on a loaded host (seen by the periodic check and a re-check at
            # once) does not eject a working instance.
            if inst.slow_since is None:
                inst.slow_since = started
            if time.monotonic() - inst.slow_since >= 1.9 * timeout:  # 2 timeouts, less timer slack
                self.eject(inst, f"health check failed: {e.code().name}")
            return
        inst.slow_since = None
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            if not inst.healthy and self.verify is not None:
                refusal = await self.verify(inst)
                if inst.healthy:  # an overlapping check admitted it meanwhile
                    return
                if refusal:
                    self.refuse(inst, refusal)
                    return
            self.admit(inst)
            if self.watch is not None:
                await self.watch(inst)
        else:
            self.drain(inst, "health check: not serving")

    def recheck(self, insts: list[Instance]) -> None:
        """Checks these now, in the background (a call on them just failed): a
        dead one is ejected for every request without the failed request
        waiting for the check. The pool holds the tasks; close() ends them."""
        for inst in insts:
            task = asyncio.get_running_loop().create_task(self.check(inst))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def check_all(self) -> None:
        self._follow_source()
        if time.monotonic() - self._resolved_at >= self.dns_refresh_s or not self.instances:
            await self.refresh_dns()
        await asyncio.gather(*(self.check(i) for i in list(self.instances.values())))

    async def start(self) -> None:
        """Resolves, checks once (so start-up sees the real state), then keeps
        checking in the background."""
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"epd-health-{self.role}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:
                logger.exception("%s health round failed", self.role)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in [*self._closing, *self._checks]:
            task.cancel()
        await asyncio.gather(*self._closing, *self._checks, *(i.channel.close() for i in self.instances.values()),
                             return_exceptions=True)
