"""Bounds on what one Transfer peer can make the producer hold.

The producer's Transfer server (``ectransfer.server``) and its control lane
(``ectransfer.lane``) serve whoever completes the handshake; a broken or
hostile consumer must not grow the encoder's memory, tasks or pinned pool
slots without bound. ``TransferLimits`` is the server's half of
``ConnectorConfig`` (built by ``ConnectorConfig.transfer_limits``); the
outbound store's record caps travel to ``OutboundStore`` from the same config.

What happens at each bound:

- ``max_sessions``: a Transfer stream beyond it ends with RESOURCE_EXHAUSTED,
  a lane connection beyond it is closed; both with a log line.
- ``max_reserves_per_session``: a Reserve beyond it is answered with
  ``ItemError.RESOURCE_EXHAUSTED`` instead of getting a serve task.
- ``max_stream_queued_bytes``: a serve task waits for the stream to take its
  queued messages (gRPC's write flow control, or the lane socket's buffer)
  before it queues more; one that waits ``send_stall_s`` gives its item up
  (its hold ends, the consumer's watchdog fails it).
- ``max_in_place_hold_s``: an item held for a consumer reading it in place
  (shm, CUDA IPC) and neither acked nor cancelled by then is let go; its
  lease restarts (the consumer may still be copying), then frees the slot.
- ``keepalive_s`` / ``keepalive_timeout_s``: HTTP/2 pings find a peer that
  vanished without closing its connection, which ends its session.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ectransfer.protocol import CLIENT_KEEPALIVE_S, TRANSFER_GRPC_OPTIONS

SERVER_MAX_RECEIVE = 1 << 20
"""Largest message a Transfer server takes from a consumer (control messages are a few hundred bytes)."""


class StreamStalled(Exception):
    """A consumer has not taken its session's queued messages within ``send_stall_s``."""


@dataclass(frozen=True)
class TransferLimits:
    max_sessions: int = 64
    """Concurrent Transfer sessions: gRPC streams (handshake probes included) plus lane connections."""
    max_reserves_per_session: int = 1024
    """Outstanding Reserves of one session: items waiting or being sent plus items held in place."""
    max_stream_queued_bytes: int = 16 << 20
    """Bytes of messages queued for one session and not yet taken by its stream (at least one message)."""
    send_stall_s: float = 30.0
    """A serve task that cannot queue its next message for this long gives its item up."""
    max_in_place_hold_s: float = 60.0
    """An in-place hold (shm, CUDA IPC) not acked or cancelled within this time ends (the lease restarts)."""
    keepalive_s: float = 30.0
    """Seconds between the server's HTTP/2 pings on a Transfer connection."""
    keepalive_timeout_s: float = 10.0
    """A connection whose ping is not answered within this time is closed (its sessions end)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")

    def server_options(self) -> list[tuple[str, int]]:
        """grpc.aio server options: the shared message limits, the server's own
        pings, and a ping policy that accepts the client's keepalive pings
        (``protocol.CLIENT_KEEPALIVE_S``) instead of answering them with GOAWAY
        ("too_many_pings"), which grpc does by default for pings closer than 5 min."""
        own = {
            # A consumer sends only control messages (Hello, Reserve, Ack, Cancel): an
            # unauthenticated first message (read before its refusal) is bounded by this.
            "grpc.max_receive_message_length": SERVER_MAX_RECEIVE,
            "grpc.keepalive_time_ms": int(self.keepalive_s * 1000),
            "grpc.keepalive_timeout_ms": int(self.keepalive_timeout_s * 1000),
            # Any unacked ping (a BDP probe sent just before the peer froze holds
            # the one in-flight ping slot, so no keepalive ping follows) closes
            # the connection after the same time, not grpc's default minute.
            "grpc.http2.ping_timeout_ms": int(self.keepalive_timeout_s * 1000),
            "grpc.keepalive_permit_without_calls": 1,
            "grpc.http2.max_pings_without_data": 0,  # keep pinging an idle stream
            "grpc.http2.min_ping_interval_without_data_ms": int(min(10.0, CLIENT_KEEPALIVE_S / 2) * 1000),
            "grpc.http2.max_ping_strikes": 0,  # never GOAWAY a client for pinging
        }
        return [(k, v) for k, v in TRANSFER_GRPC_OPTIONS if k not in own] + list(own.items())
