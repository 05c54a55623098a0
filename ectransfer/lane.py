"""The same-host control lane: Transfer item messages over a unix socket.

gRPC costs a few hundred microseconds per message here (grpcio's completion
queue thread, HTTP/2 framing, two loop wake-ups); a unix stream socket between
the same two asyncio loops costs tens. For in-place transports (shm, CUDA IPC)
the bytes never travel on the stream anyway, so once the gRPC handshake has
chosen one, the consumer may move the rest of the stream -- Reserve, Ack,
Cancel one way, ItemHeader and ItemError the other -- to the producer's lane.

Wire format: each frame is a 4-byte little-endian length and a serialized
``TransferClientMsg`` (consumer to producer) or ``TransferServerMsg``. The
first client frame is ``Select`` whose ``proof`` is the lane secret of the
consumer's gRPC Transfer stream: 32 random bytes the producer made for that
stream alone and sent in its ``Selected`` (after the stream's own proof, the
nonce read through the shared segment or handle, verified: only a process that
can map the producer's memory gets one). A secret opens one lane connection
and is forgotten when its stream ends, so neither the reusable probe nonce nor
another (or an earlier) session's secret opens a lane. The producer answers
``Selected`` or closes the connection. Closing the connection ends the
session exactly like ending the gRPC stream: the producer drops the holds of
its in-place items (their lease restarts) and the consumer fails what was in
flight. Lane connections count towards the producer's session limit
(``TransferLimits.max_sessions``); one beyond it is closed unread.

The socket lives in the abstract namespace (no file, gone with the process);
it is reachable from the producer's network namespace only, so a consumer in
another one falls back to the gRPC stream.
"""

from __future__ import annotations

import asyncio
import socket
import uuid

from ectransfer.limits import StreamStalled

MAX_FRAME = 1 << 20  # control messages only: headers, errors, acks
MAX_FIRST_FRAME = 4096  # the Select that opens a connection (before its proof is checked)
FIRST_FRAME_S = 5.0  # how long a new connection may take to prove itself


def new_address() -> str:
    """A fresh abstract-socket name (without the leading NUL)."""
    return f"epd-lane-{uuid.uuid4().hex}"


def frame(msg) -> bytes:
    data = msg.SerializeToString()
    return len(data).to_bytes(4, "little") + data


async def read_frame(reader: asyncio.StreamReader, cls, max_nbytes: int = MAX_FRAME):
    """The next message, or None at a clean end of the connection. Raises
    ConnectionError for a torn or oversized frame or one that does not parse."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("lane closed inside a frame header") from None
        return None
    n = int.from_bytes(head, "little")
    if n > max_nbytes:
        raise ConnectionError(f"lane frame of {n} bytes exceeds {max_nbytes}")
    try:
        data = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ConnectionError("lane closed inside a frame") from None
    try:
        return cls.FromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError: a broken peer
        raise ConnectionError(f"unparseable lane frame: {e}") from None


async def listen(address: str, handler) -> asyncio.AbstractServer:
    """Serves ``handler(reader, writer)`` on abstract socket ``address``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + address)
        sock.listen(64)
        sock.setblocking(False)
        return await asyncio.start_unix_server(handler, sock=sock)
    except BaseException:
        sock.close()
        raise


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Blocking, in a worker thread: uvloop's async connect refuses abstract
        # names, and a full listen backlog must not stall the caller's loop.
        sock.settimeout(2.0)
        await asyncio.to_thread(sock.connect, "\0" + address)
        sock.setblocking(False)
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


class FrameOut:
    """The producer's item messages onto a lane: ``await put(msg)`` writes a
    frame, then waits while more than ``max_bytes`` sit unsent in the socket's
    buffer (a consumer that stops reading), raising
    ``limits.StreamStalled`` after ``stall_s``. ``put(None)``, the end of a
    session, writes nothing: the handler closes the connection."""

    def __init__(self, writer: asyncio.StreamWriter, max_bytes: int = 1 << 20, stall_s: float = 30.0) -> None:
        self.writer = writer
        self.max_bytes = max_bytes
        self.stall_s = stall_s

    async def put(self, msg) -> None:
        if msg is None:
            return
        if self.writer.is_closing():  # the consumer went away: its session is closing
            return
        self.writer.write(frame(msg))
        if self.writer.transport.get_write_buffer_size() > self.max_bytes:
            try:
                await asyncio.wait_for(self.writer.drain(), self.stall_s)
            except asyncio.TimeoutError:
                raise StreamStalled(f"{self.writer.transport.get_write_buffer_size()} bytes unread "
                                    f"for {self.stall_s}s") from None
