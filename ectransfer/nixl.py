"""NIXL: the consumer pulls each item out of the encoder's outbound pool with a one-sided READ.

Between hosts the bytes need not ride the gRPC stream: NIXL (over UCX, which picks its own
wire: TCP, shared memory or CMA on one host, RDMA where the cluster has it; see
docs/configuration.md, "NIXL transport") moves them straight from the producer's pool
into the consumer's inbound staging. Everything else stays on the authenticated Transfer
stream: the handshake carries the producer agent's metadata (``NixlProbe``), each
ItemHeader a range of its pool (``NixlRef``), and the consumer's Ack frees it.

Why READ (the consumer pulls) and not WRITE (the producer pushes):

- the producer loads nothing from its consumers: no remote agent per LM, no consumer
  descriptors to trust, no registration of consumer memory it could scribble over; an
  encoder serving many LMs keeps one agent and one registration;
- the consumer checks the range against the region the producer proved in the handshake
  before any READ is posted, and learns of completion locally (no notification needed to
  know its bytes landed), then acks on the stream as every transport does;
- the producer keeps the slot from the header until that Ack (``in_place`` on the
  producer half), exactly as for shared memory: a READ never races a reused slot.

No listener: the agent is made with NIXL's listen thread off (``enable_listen_thread=False``);
metadata travels only in ``NixlProbe`` on the Transfer stream, loaded with
``add_remote_agent`` and removed with ``remove_remote_agent`` when that stream ends
(``NixlConsumer.release``). UCX's TCP transport still accepts its own wire-up connections on
an ephemeral port (docs/design.md, "NIXL transport": trust).

Progress: a READ over TCP needs the producer's UCX worker to make progress, and NIXL's own
progress thread spins a core forever. The producer runs ``Progress`` instead: a thread that
drives the agent while reads are outstanding (each READ carries its ``NixlRef.notif``, which
ends that read's entry) and otherwise polls slowly. The consumer posts its READ and polls it
to completion on the transfer client's thread (``READ_TIMEOUT_S`` at most; a producer killed
mid-READ fails the item, the stream's end then releases the remote agent).

Ownership: one agent per process and role (``process_agent``: an encoder has a producer's, an
LM a consumer's; a test or benchmark process may have both), never destroyed (NIXL has no
destroy; it goes with the process). The producer transport registers the outbound pool once
in ``build`` and deregisters it in ``close``; the pool stays the caller's. The consumer
transport registers each inbound staging region once (the storage behind the destinations
it is handed, at most ``MAX_LOCAL_REGIONS``) and deregisters them, and removes every remote
agent it loaded, in ``close``. It never owns the destinations: the caller does.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ectransfer.base import ConsumerTransport, Landed, ProducerTransport, Receiver, proof_matches, seal_proof
from ectransfer.nixl_agent import Agent, Progress, process_agent, usable
from ectransfer.pool import Pool, check_range
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2

logger = logging.getLogger(__name__)

MAX_METADATA_NBYTES = 64 << 10  # an agent's metadata is a few hundred bytes (UCX worker address, rkeys)
MAX_PROBE_NBYTES = 4096
MAX_NOTIF_NBYTES = 64
MAX_REMOTE_AGENTS = 64  # producers loaded at once by one consumer (a stream each); the oldest goes beyond
MAX_LOCAL_REGIONS = 8  # inbound staging regions registered at once by one consumer
READ_TIMEOUT_S = 30.0  # a READ not done by then fails its item (the producer died or its host vanished)
NONCE_NBYTES = 16


def _mem_of(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


class NixlProducer(ProducerTransport):
    """Serves an outbound pool (host memory, or a GPU pool where UCX can register VRAM) by
    registering it with the process agent once; each item travels as (agent, offset).

    Holds one small slot of the pool with a random nonce: the consumer's probe READs it back
    over NIXL, which proves the whole path (metadata, UCX wire-up, registration) before the
    stream selects NIXL."""

    name = "nixl"
    kind = transfer_pb2.NIXL
    in_place = True  # the consumer reads the slot itself: the server holds it until the Ack

    @classmethod
    def describes(cls, pool: Pool) -> bool:
        if pool.buffer.device.type == "cpu":
            return True
        return usable() is None and "VRAM_SEG" in process_agent("producer").mem_types

    @classmethod
    def build(cls, pool: Pool, chunk_nbytes: int) -> NixlProducer:
        return cls(pool=pool)

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.agent = process_agent("producer")
        self.mem_type, self.device_id = _mem_of(pool.buffer)
        self._base = pool.buffer.data_ptr()
        self._descs = self.agent.register(self._base, pool.capacity, self.mem_type, self.device_id)
        self._nonce = secrets.token_bytes(NONCE_NBYTES)
        self._probe = pool.alloc(NONCE_NBYTES)
        pool.view(self._probe).copy_(torch.frombuffer(bytearray(self._nonce), dtype=torch.uint8))
        self.progress = Progress(self.agent)
        self.progress.start()
        self._metadata = self.agent.nixl.get_agent_metadata()  # after the registration: it carries the rkey

    def offer(self) -> transfer_pb2.TransportOffer:
        return transfer_pb2.TransportOffer(transport=self.kind, nixl_probe=transfer_pb2.NixlProbe(
            agent_metadata=self._metadata, agent=self.agent.name, region_address=self._base,
            region_nbytes=self.pool.capacity, mem_type=self.mem_type, device_id=self.device_id,
            probe_offset=self._probe.offset, probe_nbytes=NONCE_NBYTES))

    def verify(self, proof: bytes, challenge: bytes) -> bool:
        return proof_matches(proof, self._nonce, challenge)

    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None:
        offset = data.data_ptr() - self._base if data.numel() else 0
        token = secrets.token_bytes(12)
        desc.nixl.agent = self.agent.name
        desc.nixl.offset = offset
        desc.nixl.region_nbytes = self.pool.capacity
        desc.nixl.notif = token
        self.progress.expect(token)

    def close(self) -> None:
        self.progress.stop()
        self.agent.deregister(self._descs)


@dataclass
class _Remote:
    """A producer agent this consumer loaded, and the streams whose handshake proved it."""

    probe: transfer_pb2.NixlProbe
    streams: set[bytes] = field(default_factory=set)  # offer challenges: one per Transfer stream
    used: float = field(default_factory=time.monotonic)


class NixlConsumer(ConsumerTransport):
    """READs each item from the producer's registered pool into ``dest`` (inbound staging),
    on the transfer client's thread, before the receiver is returned (like shm's copy)."""

    name = "nixl"
    kind = transfer_pb2.NIXL
    payload = "nixl"

    @classmethod
    def for_service(cls) -> ConsumerTransport:
        return OfferedNixl()

    def __init__(self, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.read_timeout_s = read_timeout_s
        self._agent: Agent | None = None
        self._remotes: OrderedDict[str, _Remote] = OrderedDict()
        self._local: OrderedDict[tuple[int, int], tuple[object, torch.UntypedStorage | torch.Tensor]] = OrderedDict()
        self._scratch: torch.Tensor | None = None
        self.reads = 0  # READs completed (tests, stats)

    @property
    def agent(self) -> Agent:
        if self._agent is None:
            try:
                self._agent = process_agent("consumer")
            except Exception as e:  # noqa: BLE001 - no UCX here: the stream falls back
                raise ProtocolError(f"no NIXL agent in this process: {e}") from None
        return self._agent

    @property
    def remote_agents(self) -> list[str]:
        """Names of the producer agents loaded now (tests check none is left behind)."""
        return list(self._remotes)

    @property
    def registered_regions(self) -> int:
        return len(self._local)

    # -- handshake ------------------------------------------------------------

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        if (why := usable()) is not None:
            raise ProtocolError(why)
        if not offer.HasField("nixl_probe"):
            raise ProtocolError("a NIXL offer without its probe")
        p = offer.nixl_probe
        if not 0 < len(p.agent_metadata) <= MAX_METADATA_NBYTES:
            raise ProtocolError(f"agent metadata of {len(p.agent_metadata)} bytes (1-{MAX_METADATA_NBYTES} allowed)")
        if p.mem_type not in ("DRAM", "VRAM") or f"{p.mem_type}_SEG" not in self.agent.mem_types:
            raise ProtocolError(f"the producer's pool is {p.mem_type or 'unnamed'} memory, which UCX here cannot read")
        if not 0 < p.probe_nbytes <= MAX_PROBE_NBYTES:
            raise ProtocolError(f"probe of {p.probe_nbytes} bytes (1-{MAX_PROBE_NBYTES} allowed)")
        check_range(p.probe_offset, p.probe_nbytes, p.region_nbytes, "NIXL probe in the producer's region")
        if p.agent == self.agent.name:
            raise ProtocolError("the producer's agent is this process's own")
        known = self._remotes.get(p.agent)
        if known is not None and known.probe.agent_metadata != p.agent_metadata:
            self._remove(p.agent)  # the same name with other metadata: load it afresh
            known = None
        if known is None:
            try:
                loaded = self.agent.nixl.add_remote_agent(p.agent_metadata)
            except Exception as e:  # noqa: BLE001 - garbage, or an agent UCX cannot reach
                raise ProtocolError(f"cannot load the producer's NIXL agent: {e}") from None
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != p.agent:
                self._forget_agent(name)
                raise ProtocolError(f"the metadata names agent {name!r}, the offer {p.agent!r}")
            known = self._remotes[p.agent] = _Remote(transfer_pb2.NixlProbe())
            known.probe.CopyFrom(p)
            self._evict()
        try:
            scratch = self._scratch_for(p.probe_nbytes)
            self._read(known.probe, p.probe_offset, scratch, b"")
        except ProtocolError:
            if not known.streams:
                self._remove(p.agent)
            raise
        known.streams.add(bytes(offer.challenge))
        known.used = time.monotonic()
        return seal_proof(scratch.numpy().tobytes(), offer.challenge)

    def release(self, offer: transfer_pb2.TransportOffer | None) -> None:
        """The stream whose handshake chose ``offer`` ended: its producer's agent is removed once
        no other stream of this consumer uses it."""
        if offer is None or not offer.HasField("nixl_probe"):
            return
        known = self._remotes.get(offer.nixl_probe.agent)
        if known is None:
            return
        known.streams.discard(bytes(offer.challenge))
        if not known.streams:
            self._remove(offer.nixl_probe.agent)

    def _evict(self) -> None:
        """Beyond ``MAX_REMOTE_AGENTS``, the least recently used agents go (a handshake that
        probed and then broke before Select leaves one that no stream releases)."""
        while len(self._remotes) > MAX_REMOTE_AGENTS:
            oldest = min(self._remotes, key=lambda n: self._remotes[n].used)
            logger.warning("NIXL: more than %d producer agents loaded; removing %s", MAX_REMOTE_AGENTS, oldest)
            self._remove(oldest)

    def _remove(self, name: str) -> None:
        self._remotes.pop(name, None)
        self._forget_agent(name)

    def _forget_agent(self, name: str) -> None:
        try:
            self.agent.nixl.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("NIXL: removing agent %s: %s", name, e)

    # -- items ----------------------------------------------------------------

    def check_source(self, desc: transfer_pb2.TensorDescriptor,
                     proven: transfer_pb2.TransportOffer | None) -> None:
        super().check_source(desc, proven)
        if proven is None or not proven.HasField("nixl_probe"):
            raise ProtocolError("a NIXL item on a stream whose handshake proved no NIXL agent")
        self._range(desc, proven.nixl_probe)

    @staticmethod
    def _range(desc: transfer_pb2.TensorDescriptor, probe: transfer_pb2.NixlProbe) -> None:
        ref = desc.nixl
        if ref.agent != probe.agent:
            raise ProtocolError(f"item of NIXL agent {ref.agent!r}, but the encoder proved {probe.agent!r}")
        if ref.region_nbytes != probe.region_nbytes:
            raise ProtocolError(f"item in a region of {ref.region_nbytes} bytes, "
                                f"but the encoder proved {probe.region_nbytes}")
        if len(ref.notif) > MAX_NOTIF_NBYTES:
            raise ProtocolError(f"NIXL notification of {len(ref.notif)} bytes (at most {MAX_NOTIF_NBYTES})")
        check_range(ref.offset, desc.nbytes, probe.region_nbytes, f"NIXL item in {probe.agent!r}'s region")

    def receiver(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> Receiver:
        if desc.WhichOneof("payload") != "nixl":
            raise ProtocolError(f"expected a NIXL payload, got {desc.WhichOneof('payload')}")
        known = self._remotes.get(desc.nixl.agent)
        if known is None:
            raise ProtocolError(f"NIXL agent {desc.nixl.agent!r} is not loaded here (its stream ended)")
        self._range(desc, known.probe)  # again, against what was loaded: no READ outside the proven region
        if dest.numel() != desc.nbytes:
            raise ProtocolError(f"destination has {dest.numel()} bytes, tensor needs {desc.nbytes}")
        if desc.nbytes:
            self._read(known.probe, desc.nixl.offset, dest, bytes(desc.nixl.notif))
            self.reads += 1
        known.used = time.monotonic()
        return Landed()

    def _read(self, probe: transfer_pb2.NixlProbe, offset: int, dest: torch.Tensor, notif: bytes) -> None:
        """One READ of ``dest.numel()`` bytes at ``offset`` of the producer's region into ``dest``,
        polled to completion here. Raises ProtocolError (the handle is released either way)."""
        if not dest.is_contiguous() or dest.dtype != torch.uint8:
            raise ProtocolError("a NIXL destination must be a contiguous uint8 buffer")
        nixl = self.agent.nixl
        mem_type, device_id = _mem_of(dest)
        self._register(dest, mem_type, device_id)
        nbytes = dest.numel()
        handle = None
        try:
            local = nixl.get_xfer_descs([(dest.data_ptr(), nbytes, device_id)], mem_type)
            remote = nixl.get_xfer_descs([(probe.region_address + offset, nbytes, probe.device_id)], probe.mem_type)
            handle = nixl.initialize_xfer("READ", local, remote, probe.agent, notif)
            state = nixl.transfer(handle)
            deadline = time.monotonic() + self.read_timeout_s
            spins = 0
            while state == "PROC":
                state = nixl.check_xfer_state(handle)
                spins += 1
                if spins % 64 == 0:
                    if time.monotonic() > deadline:
                        raise ProtocolError(f"NIXL READ of {nbytes} bytes from {probe.agent} "
                                            f"not done within {self.read_timeout_s}s")
                    time.sleep(0)
            if state != "DONE":
                raise ProtocolError(f"NIXL READ of {nbytes} bytes from {probe.agent} failed ({state})")
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - nixl raises its own errors (peer gone, not registered)
            raise ProtocolError(f"NIXL READ from {probe.agent} failed: {e}") from None
        finally:
            if handle is not None:
                try:
                    nixl.release_xfer_handle(handle)
                except Exception as e:  # noqa: BLE001 - an aborted READ: UCX cancels it
                    logger.debug("NIXL: releasing a READ handle: %s", e)

    def _register(self, dest: torch.Tensor, mem_type: str, device_id: int) -> None:
        """Registers the whole region behind ``dest`` (its storage: the inbound staging) once."""
        storage = dest.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in self._local:
            self._local.move_to_end(key)
            return
        try:
            descs = self.agent.register(key[0], key[1], mem_type, device_id)
        except Exception as e:  # noqa: BLE001
            raise ProtocolError(f"cannot register {key[1]} bytes of inbound staging with NIXL: {e}") from None
        self._local[key] = (descs, storage)  # the storage stays alive while registered
        while len(self._local) > MAX_LOCAL_REGIONS:
            _, (old, _) = self._local.popitem(last=False)
            self.agent.deregister(old)

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.zeros(MAX_PROBE_NBYTES, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def close(self) -> None:
        if self._agent is None:
            return
        for name in list(self._remotes):
            self._remove(name)
        for descs, _ in self._local.values():
            self._agent.deregister(descs)
        self._local.clear()


class OfferedNixl(ConsumerTransport):
    """NIXL as the LM *service* process sees it: usable when offered and NIXL imports here. It
    makes no agent (no UCX in the service process), so the handshake stops before Select; the
    engine's connector proves it for real (its probe READs the producer's nonce)."""

    name = "nixl"
    kind = transfer_pb2.NIXL
    payload = "nixl"
    provisional = True

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        if (why := usable()) is not None:
            raise ProtocolError(why)
        if not offer.HasField("nixl_probe") or not offer.nixl_probe.agent_metadata:
            raise ProtocolError("a NIXL offer without its probe")
        return b""

    def receiver(self, desc, dest):
        raise ProtocolError("the LM service never receives items itself")
