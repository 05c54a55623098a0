"""POSIX shared memory: segments, a pool backed by one, and the SHM transport.

Segments live in /dev/shm, are created 0600 with O_EXCL by their owner, are
named ``epd-<role>-<pid>-<random>`` and are unlinked by that owner on close.
The owner holds a shared ``flock`` on the segment for as long as it lives; the
kernel drops it when the process dies, even by ``kill -9``. ``cleanup_orphans``
unlinks the segments nobody holds, and every owner calls it when it starts.
The lock, not the pid in the name, decides: containers that share /dev/shm
but not a PID namespace must not remove each other's live segments.

SHM transport: the producer's outbound pool is a segment; an item travels as
(segment, offset) and the consumer copies it out of its mapping, which it opens
once per segment and caches. The producer's slot stays allocated until the
consumer acks, so the bytes cannot change under the copy.

This process's own segments are also listed (``unlink_created``): an engine
whose service died (``ectransfer.connector.lifeline``) unlinks them at once,
before its orderly stop, which may never finish.

The consumer does not trust the names and ranges a producer sends: it maps
only regular files (``O_NOFOLLOW``, ``S_ISREG``) whose name has the form this
project creates (``validate_peer_segment``: ``epd-<role>-<pid>-<hex>``, never
an LM's inbound staging), and checks every range against the size of its own
mapping, not the size the producer claims. ``cleanup_orphans`` likewise looks
only at regular files, opened without blocking or following links, and skips
with a warning whatever it cannot open, lock or unlink: /dev/shm is shared with
other users and containers, and a foreign entry must not stop a service starting.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import warnings

import torch

from ectransfer.base import ConsumerTransport, Landed, ProducerTransport, Receiver, proof_matches, seal_proof
from ectransfer.lockfile import create_held, open_regular, sweep
from ectransfer.pool import ALIGNMENT, Pool, check_range
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_OWNED = re.compile(r"^epd-[a-z]+-(\d+)-[0-9a-f]+$")
_NOT_PEER_ROLES = frozenset({"staging"})  # an LM's inbound staging: other requests' embeddings, never a producer's
MAX_PROBE_NBYTES = 4096  # a probe reads a nonce back, not data


_created: set[str] = set()
"""Names of the segments this process created and has not unlinked yet: added by
``ShmSegment.create``, removed by the owner's ``unlink``; read by ``unlink_created``."""


def unlink_created() -> list[str]:
    """Unlinks every segment this process created and still owns, and returns their names. The
    mappings stay valid (the memory goes when the last mapping does); only the names go, so no
    other process can map them again and nothing is left in /dev/shm. Called by the engine's
    lifeline thread once the service that started the engine is gone; safe beside a ``close`` on
    another thread (a segment unlinked twice is skipped)."""
    removed = []
    for name in list(_created):
        _created.discard(name)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        except OSError as e:
            logger.warning("cannot unlink %s/%s (%s)", SHM_DIR, name, e.strerror or e)
            continue
        removed.append(name)
    return removed


def validate_name(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}: use 1-200 of [A-Za-z0-9_.-], no path separators")
    return name


def validate_peer_segment(name: str) -> str:
    """A segment name a producer may hand a consumer: the form ``new_name``
    makes (``epd-<role>-<pid>-<hex>``, so never vLLM's ``psm_*`` or any other
    file in /dev/shm) and not an LM's inbound staging. Raises ProtocolError."""
    if not isinstance(name, str) or len(name) > 200 or _OWNED.fullmatch(name) is None:
        raise ProtocolError(f"shared-memory segment {name!r} is not an epd segment (epd-<role>-<pid>-<hex>)")
    role = name.split("-")[1]
    if role in _NOT_PEER_ROLES:
        raise ProtocolError(f"shared-memory segment {name!r} is an LM's {role}, not a producer's pool")
    return name


def new_name(role: str) -> str:
    return f"epd-{role}-{os.getpid()}-{secrets.token_hex(6)}"


def cleanup_orphans() -> list[str]:
    """Unlinks epd segments whose owner no longer holds them (it died), and
    returns their names (``lockfile.sweep``).

    Every service calls this as it starts, and /dev/shm is shared with
    whatever else runs on the host (other users, other containers), so an
    entry it cannot judge or remove (permission denied, a directory, a lock
    it cannot take) is skipped with a warning: this never raises OSError."""
    return sweep(SHM_DIR, _OWNED, logger, "shared-memory segment(s)")


class ShmSegment:
    """One mapping of a /dev/shm segment. ``create`` makes the caller the owner
    (who must ``unlink``); ``attach`` maps an existing one."""

    def __init__(self, name: str, fd: int, nbytes: int, owner: bool, readonly: bool) -> None:
        self.name, self.nbytes, self.owner = name, nbytes, owner
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        try:
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(fd)
            raise
        if owner:
            self._fd: int | None = fd  # holds create's flock (liveness for cleanup_orphans) until close
        else:
            os.close(fd)
            self._fd = None
        with warnings.catch_warnings():
            # A read-only mapping: torch cannot mark the tensor read-only, and we never write it.
            warnings.simplefilter("ignore", UserWarning)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmSegment:
        if nbytes <= 0:
            raise ValueError(f"a shared-memory segment needs > 0 bytes, got {nbytes}")
        path = os.path.join(SHM_DIR, validate_name(name))
        # Locked before anything else: another service's cleanup_orphans at this
        # moment (epd up starts them together) must see it as alive.
        fd = create_held(path, os.O_RDWR)
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        _created.add(name)
        return cls(name, fd, nbytes, owner=True, readonly=False)

    @classmethod
    def attach(cls, name: str, readonly: bool = True) -> ShmSegment:
        path = os.path.join(SHM_DIR, validate_name(name))
        fd = open_regular(path, os.O_RDONLY if readonly else os.O_RDWR)
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            raise ValueError(f"shared-memory segment {name!r} is empty")
        return cls(name, fd, size, owner=False, readonly=readonly)

    def close(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping goes with it
        if self.owner:
            self.unlink()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        _created.discard(self.name)
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class ShmPool(Pool):
    """A Pool whose backing buffer is a shared-memory segment this process owns."""

    def __init__(self, capacity: int, role: str, alignment: int = ALIGNMENT) -> None:
        cleanup_orphans()
        self.segment = ShmSegment.create(new_name(role), capacity)
        super().__init__(capacity, alignment)

    def _make_buffer(self, capacity: int) -> torch.Tensor:
        return self.segment.buffer

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        super().close()
        self.segment.close()


class Mappings:
    """Segments this process attached, mapped once each (cached by name)."""

    def __init__(self) -> None:
        self._segments: dict[tuple[str, bool], ShmSegment] = {}

    def get(self, name: str, writable: bool = False) -> ShmSegment:
        seg = self._segments.get((name, writable))
        if seg is None:
            seg = self._segments[(name, writable)] = ShmSegment.attach(name, readonly=not writable)
        return seg

    def drop(self, name: str) -> None:
        """Unmaps ``name`` (both modes) if mapped: a segment whose producer is gone."""
        for key in [(name, False), (name, True)]:
            seg = self._segments.pop(key, None)
            if seg is not None:
                seg.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


class ShmProducer(ProducerTransport):
    """Describes items of a ShmPool by (segment, offset); sends no bytes.

    Holds one small slot of the pool with a random nonce: a consumer proves it
    maps the very same memory by reading the nonce back (capability, not hostname)."""

    name = "shm"
    kind = transfer_pb2.SHM
    in_place = True
    pool_priority = 1
    NONCE_NBYTES = 16

    @classmethod
    def describes(cls, pool: Pool) -> bool:
        return isinstance(pool, ShmPool)  # a segment and an offset: not device memory

    def __init__(self, pool: ShmPool) -> None:
        self.pool = pool
        self._nonce = secrets.token_bytes(self.NONCE_NBYTES)
        self._probe = pool.alloc(self.NONCE_NBYTES)
        pool.view(self._probe).copy_(torch.frombuffer(bytearray(self._nonce), dtype=torch.uint8))

    def offer(self) -> transfer_pb2.TransportOffer:
        return transfer_pb2.TransportOffer(transport=self.kind, shm_probe=transfer_pb2.ShmProbe(
            segment=self.pool.name, offset=self._probe.offset, nbytes=self.NONCE_NBYTES))

    def verify(self, proof: bytes, challenge: bytes) -> bool:
        return proof_matches(proof, self._nonce, challenge)

    def describe(self, data: torch.Tensor, desc: transfer_pb2.TensorDescriptor) -> None:
        offset = data.data_ptr() - self.pool.buffer.data_ptr() if data.numel() else 0
        desc.shm.segment = self.pool.name
        desc.shm.offset = offset
        desc.shm.segment_nbytes = self.pool.capacity


class ShmConsumer(ConsumerTransport):
    """Copies an item out of the producer's segment into ``dest`` at once."""

    name = "shm"
    kind = transfer_pb2.SHM
    payload = "shm"
    in_place = True

    def __init__(self) -> None:
        self.mappings = Mappings()

    def _map(self, name: str) -> ShmSegment:
        """The producer's segment ``name``, mapped read-only once; only an epd
        producer segment that is a regular file (ProtocolError otherwise)."""
        validate_peer_segment(name)
        try:
            return self.mappings.get(name)
        except (OSError, ValueError) as e:
            raise ProtocolError(f"cannot map shared-memory segment {name!r}: {e}") from None

    def probe(self, offer: transfer_pb2.TransportOffer) -> bytes:
        p = offer.shm_probe
        if not 0 < p.nbytes <= MAX_PROBE_NBYTES:
            raise ProtocolError(f"probe of {p.nbytes} bytes (1-{MAX_PROBE_NBYTES} allowed)")
        seg = self._map(p.segment)
        check_range(p.offset, p.nbytes, seg.nbytes, f"probe in segment {p.segment!r}")
        return seal_proof(seg.buffer[p.offset : p.offset + p.nbytes].numpy().tobytes(), offer.challenge)

    def locate(self, desc: transfer_pb2.TensorDescriptor) -> ShmSegment:
        if desc.WhichOneof("payload") != "shm":
            raise ProtocolError(f"expected a shared-memory payload, got {desc.WhichOneof('payload')}")
        ref = desc.shm
        seg = self._map(ref.segment)
        check_range(ref.offset, desc.nbytes, seg.nbytes, f"shm item in segment {ref.segment!r}")
        return seg

    def receiver(self, desc: transfer_pb2.TensorDescriptor, dest: torch.Tensor) -> Receiver:
        seg = self.locate(desc)
        if dest.numel() != desc.nbytes:
            raise ProtocolError(f"destination has {dest.numel()} bytes, tensor needs {desc.nbytes}")
        if desc.nbytes:
            dest.copy_(seg.buffer[desc.shm.offset : desc.shm.offset + desc.nbytes])
        return Landed()

    def check_source(self, desc: transfer_pb2.TensorDescriptor,
                     proven: transfer_pb2.TransportOffer | None) -> None:
        super().check_source(desc, proven)
        if proven is None or not proven.HasField("shm_probe"):
            raise ProtocolError("a shm item on a stream whose handshake proved no such memory")
        if desc.shm.segment != proven.shm_probe.segment:
            raise ProtocolError(f"item in segment {desc.shm.segment!r}, "
                                f"but the encoder proved {proven.shm_probe.segment!r}")

    def where(self, desc: transfer_pb2.TensorDescriptor) -> tuple[str, int]:
        return desc.shm.segment, desc.shm.offset

    def load(self, desc: transfer_pb2.TensorDescriptor, device: torch.device | str) -> torch.Tensor:
        seg = self.locate(desc)
        # One memcpy (or H2D copy) out of the producer's segment, which it holds until the ack.
        return seg.buffer[desc.shm.offset : desc.shm.offset + desc.nbytes].to(device, copy=True)

    def forget(self, segment: str) -> None:
        """Unmaps a segment of a producer that went away."""
        self.mappings.drop(segment)

    def close(self) -> None:
        self.mappings.close()
