"""The hostile tenant's clients for ``bench/hostile.py``: one coroutine per attack kind, each making
one request and returning how the gateway answered it (an HTTP status, a gRPC code, ``closed`` /
``reset`` for a connection that ended without a status; a never-read answer: ``cut`` when the
gateway reset its connection or ended its call, ``renewed`` when the client dropped it itself after
--answer-timeout-s + 2 s and sent a new one).

Every request carries the attacker's key (REST ``Authorization: Bearer``, gRPC ``authorization``
metadata). A request is cancelled when its phase ends: a REST connection is then aborted (a reset,
not a polite close) and a gRPC call cancelled, so what the gateway still holds afterwards is its own
doing. Owner: ``bench/hostile.py`` makes one ``Hostile`` per run (in its event loop) and closes it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import aiohttp
import grpc

from epd.gateway.v1 import gateway_pb2
from services.gateway.config import GatewayConfig

METHOD = "/epd.gateway.v1.GatewayService/ChatCompletion"
CHUNK = 1 << 20
DRIP_BODY = 4096
UPLOAD_HEADERS = 4 << 20
"""An ``upload-headers`` body: one multipart part whose header block is this many bytes of repeated
``content-disposition:`` lines (a routing-key scan that is quadratic in it takes hours)."""
SLOW_BODY = 64 << 20
"""What a slow body declares (``Content-Length``); it drips just above --body-min-rate-kib."""
SLOW_RATE = 1.25
"""A slow body's rate, in --body-min-rate-kib."""
UNREAD_RCVBUF = 4096
"""A non-reader's socket receive buffer: the kernel takes little of the answer for it."""
TCP_ESTABLISHED = 1


def note(details: dict[str, str], key: str, text: str) -> str:
    """Keeps the first message seen for ``key`` (shortened); returns ``key``."""
    if key not in details:
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        details[key] = " ".join(str(text).split())[:240]
    return key


class Hostile:
    """One request of each hostile kind (``fns``); each returns how the gateway answered it."""

    def __init__(self, port: int, gport: int, cfg: GatewayConfig, key: str, model: str, drip_s: float,
                 at_limit: bytes, grpc_at: bytes, grpc_over: bytes, answer_mib: float, stream_tokens: int) -> None:
        self.port, self.gport, self.max_body, self.drip_s, self.model = port, gport, cfg.max_body_bytes, drip_s, model
        self.key = key
        self.timeout = cfg.body_timeout_s + 30
        # A non-reader gives up on a request after this and sends a new one: it cannot see the gateway's cut
        # (a FIN queues behind the unread answer), so it renews just after the answer deadline would end it.
        self.hold_s = cfg.answer_timeout_s + 2
        self.slow_rate = int(SLOW_RATE * cfg.body_min_rate_kib * 1024)
        self.at_limit, self.grpc_at, self.grpc_over = memoryview(at_limit), grpc_at, grpc_over
        self.zeros = memoryview(bytes(CHUNK))
        self.metadata = (("authorization", f"Bearer {key}"),)
        # A non-streaming answer of about answer_mib: the stub LM answers " tok" per token.
        self.unread_whole = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": int(answer_mib * (1 << 20) / 4)}).encode()
        self.unread_stream = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": stream_tokens, "stream": True}).encode()
        self.grpc_unread = gateway_pb2.OpenAIRequest(body=self.unread_stream)
        n = UPLOAD_HEADERS // len(b"content-disposition:")
        self.upload = b"--XYZ\r\n" + b"content-disposition:" * n + b"\r\n\r\nabc\r\n--XYZ--\r\n"
        self.background = json.dumps({"model": model, "input": "hi", "background": True, "store": True}).encode()
        self.channels: list[grpc.aio.Channel] = []
        self.session: aiohttp.ClientSession | None = None
        self.details: dict[str, str] = {}
        """The first answer's message for each (kind, outcome), as "kind outcome" -> text."""
        self.fns = {"rest-declared": self.rest_declared, "rest-chunked": self.rest_chunked,
                    "rest-at-limit": self.rest_at_limit, "rest-drip": self.rest_drip,
                    "upload-headers": self.upload_headers,
                    "slow-body": self.slow_body,
                    "stream-unread": lambda _: self.unread("stream-unread", self.unread_stream),
                    "answer-unread": lambda _: self.unread("answer-unread", self.unread_whole),
                    "grpc-unread": self.grpc_unread_call,
                    "background": self.background_post,
                    "grpc-over": lambda ch: self._grpc(ch, "grpc-over", self.grpc_over),
                    "grpc-at-limit": lambda ch: self._grpc(ch, "grpc-at-limit", self.grpc_at),
                    "grpc-stall": self.grpc_stall}

    def note(self, key: str, text: str) -> str:
        return note(self.details, key, text)

    def channel(self) -> grpc.aio.Channel:
        # A connection of its own per client (no shared subchannel): 32 streams per connection is a
        # gateway limit that must not be what throttles the attack.
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{self.gport}", options=[
            ("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)])
        self.channels.append(ch)
        return ch

    def _head(self, length: str, path: str = "/v1/chat/completions", ctype: str = "application/json") -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAuthorization: Bearer {self.key}\r\n"
                f"Content-Type: {ctype}\r\nConnection: close\r\n{length}\r\n\r\n").encode()

    async def _exchange(self, kind: str, head: bytes, feed) -> str:
        """Sends ``head`` then ``feed(writer)`` while waiting for the status line (and, the first time
        a kind gets a status, the message of the answer)."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as e:
            return f"connect:{type(e).__name__}"
        writer.write(head)
        sender = asyncio.ensure_future(feed(writer))
        try:
            line = await asyncio.wait_for(reader.readline(), self.timeout)
            parts = line.split()
            if len(parts) < 2 or not line.startswith(b"HTTP/"):
                return "closed"
            status = parts[1].decode()
            if f"{kind} {status}" not in self.details:
                try:
                    rest = await asyncio.wait_for(reader.read(4096), 1.0)
                except (asyncio.TimeoutError, ConnectionError, OSError):
                    rest = b""
                self.note(f"{kind} {status}", rest.partition(b"\r\n\r\n")[2].decode(errors="replace"))
            return status
        except asyncio.TimeoutError:
            return "no answer"
        except (ConnectionError, OSError):
            return "reset"
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.transport.abort()  # close() would wait to flush a body the gateway no longer reads

    async def _send(self, writer, data, total: int) -> None:
        sent = 0
        while sent < total:
            piece = data[sent % len(data):][:min(CHUNK, total - sent)]
            writer.write(piece)
            sent += len(piece)
            await writer.drain()

    async def rest_declared(self, _=None) -> str:
        n = self.max_body + 1
        return await self._exchange("rest-declared", self._head(f"Content-Length: {n}"),
                                    lambda w: self._send(w, self.zeros, n))

    async def rest_chunked(self, _=None) -> str:
        async def feed(w):
            frame = b"%x\r\n" % CHUNK + bytes(self.zeros) + b"\r\n"
            while True:
                w.write(frame)
                await w.drain()
        return await self._exchange("rest-chunked", self._head("Transfer-Encoding: chunked"), feed)

    async def rest_at_limit(self, _=None) -> str:
        n = len(self.at_limit)
        return await self._exchange("rest-at-limit", self._head(f"Content-Length: {n}"),
                                    lambda w: self._send(w, self.at_limit, n))

    async def rest_drip(self, _=None) -> str:
        async def feed(w):
            for _ in range(DRIP_BODY):
                w.write(b" ")
                await w.drain()
                await asyncio.sleep(self.drip_s)
        return await self._exchange("rest-drip", self._head(f"Content-Length: {DRIP_BODY}"), feed)

    async def upload_headers(self, _=None) -> str:
        """A speech upload (``/v1/audio/transcriptions``) whose one part has ``UPLOAD_HEADERS`` bytes of
        ``content-disposition:`` header lines: whatever the model, the gateway reads the part headers for the
        upload's routing key."""
        n = len(self.upload)
        head = self._head(f"Content-Length: {n}", "/v1/audio/transcriptions", "multipart/form-data; boundary=XYZ")
        return await self._exchange("upload-headers", head, lambda w: self._send(w, memoryview(self.upload), n))

    async def slow_body(self, _=None) -> str:
        """Declares ``SLOW_BODY`` bytes and sends them at ``SLOW_RATE`` x --body-min-rate-kib, in 0.1 s steps."""
        async def feed(w):
            piece, t = bytes(self.slow_rate // 10), time.monotonic()
            for i in range(SLOW_BODY // len(piece)):
                w.write(piece)
                await w.drain()
                await asyncio.sleep(max(0.0, t + (i + 1) * 0.1 - time.monotonic()))
        return await self._exchange("slow-body", self._head(f"Content-Length: {SLOW_BODY}"), feed)

    async def unread(self, kind: str, body: bytes) -> str:
        """Sends a whole request and never reads its answer; ``cut`` once the connection is reset (seen in
        the socket's TCP state, which needs no read), ``renewed`` after ``hold_s``."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UNREAD_RCVBUF)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", self.port))
            await loop.sock_sendall(sock, self._head(f"Content-Length: {len(body)}") + body)
            end = time.monotonic() + self.hold_s
            while time.monotonic() < end:
                await asyncio.sleep(0.25)
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != TCP_ESTABLISHED:
                    return "cut"
            return "renewed"
        except OSError as e:
            return f"connect:{type(e).__name__}"
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            sock.close()

    async def grpc_unread_call(self, ch: grpc.aio.Channel) -> str:
        """A ChatCompletion whose answer stream is never read; the call's status once the gateway ends it."""
        call = ch.unary_stream(METHOD, request_serializer=gateway_pb2.OpenAIRequest.SerializeToString,
                               response_deserializer=bytes)(self.grpc_unread, metadata=self.metadata)
        try:
            end = time.monotonic() + self.hold_s
            while not call.done() and time.monotonic() < end:
                await asyncio.sleep(0.25)
            if not call.done():
                return "renewed"
            code = await call.code()
            self.note(f"grpc-unread {code.name}", await call.details() or "")
            return code.name
        finally:
            call.cancel()

    async def background_post(self, _=None) -> str:
        """``POST /v1/responses {"background": true}`` on a kept-alive connection."""
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=self.timeout))
        async with self.session.post(f"http://127.0.0.1:{self.port}/v1/responses", data=self.background,
                                     headers={"Authorization": f"Bearer {self.key}",
                                              "Content-Type": "application/json"}) as r:
            data = await r.read()
        if f"background {r.status}" not in self.details:
            self.note(f"background {r.status}", data.decode(errors="replace"))
        return str(r.status)

    async def _grpc(self, ch: grpc.aio.Channel, kind: str, message: bytes) -> str:
        call = ch.unary_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)
        try:
            async for _ in call(message, timeout=self.timeout, metadata=self.metadata):
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            self.note(f"{kind} {e.code().name}", e.details() or "")
            return e.code().name

    async def grpc_stall(self, ch: grpc.aio.Channel) -> str:
        """A call whose request message never comes (no request iterator: nothing is ever written)."""
        call = ch.stream_stream(METHOD, request_serializer=gateway_pb2.OpenAIRequest.SerializeToString,
                                response_deserializer=gateway_pb2.OpenAIResponse.FromString)(
            timeout=self.timeout, metadata=self.metadata)
        try:
            async for _ in call:
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            self.note(f"grpc-stall {e.code().name}", e.details() or "")
            return e.code().name
        finally:
            call.cancel()

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        self.channels.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None


async def hostile_client(hostile: Hostile, kind: str, ch: grpc.aio.Channel | None, stop: asyncio.Event,
                         events: list) -> None:
    """Loops ``kind`` until ``stop`` is set or the task is cancelled; every answer goes to ``events`` as
    (sent, answered, kind, outcome); the request cut off by the cancel is ``unanswered``. ``stop`` as
    well as the cancel: Python 3.11's ``wait_for`` can swallow a cancel that meets an answer."""
    while not stop.is_set():
        t = time.monotonic()
        try:
            outcome = await hostile.fns[kind](ch)
        except asyncio.CancelledError:
            events.append((t, time.monotonic(), kind, "unanswered"))
            raise
        except Exception as e:  # noqa: BLE001 - counted, the attack goes on
            outcome = type(e).__name__
        events.append((t, time.monotonic(), kind, outcome))
