"""Where the gateway's shared state lives, and how a process treats it: one dataclass, read by
``services.gateway.state.open_state``. Its fields become ``epd gateway`` flags (``--state-store``,
``--state-store-password-file``, ...) when the gateway runs as several processes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "unix")
UNREACHABLE = ("share", "closed")
NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class StateStoreConfig:
    url: str = ""
    """The store that holds the limits of the whole front door: ``redis://host:port[/db]``,
    ``rediss://`` (TLS) or ``unix:///path/to/redis.sock`` (Redis or Valkey). Empty: this process alone
    holds its limits, in memory (one gateway process, today's behaviour)."""
    password_file: str = ""
    """A file whose first line is the store's password (``requirepass``); empty: none. A password in the URL
    is refused, so that it never shows on a command line."""
    heartbeat_s: float = 2.0
    """How often a process tells the store it is alive, which keeps every place it holds."""
    lease_s: float = 6.0
    """How long the places of a process that stopped telling (killed with ``kill -9``, frozen, cut off)
    stay held: they go back at most this long after its last heartbeat. At least twice ``heartbeat_s``."""
    call_timeout_s: float = 0.5
    """The longest one call to the store may take; past it the store counts as unreachable."""
    unreachable: str = "share"
    """What a process does while the store is unreachable: ``share`` enforces its 1/N part of every limit
    by itself (``processes``, ``index``); ``closed`` refuses whatever a limit governs."""
    processes: int = 1
    """N: how many gateway processes share the limits (workers and replicas together)."""
    index: int = 0
    """This process's place among them, 0 to N-1: the remainder of a limit that N does not divide goes
    to the lowest indexes, so the parts add up to the limit exactly."""
    namespace: str = "epd"
    """Prefix of every key in the store (one store may serve several deployments)."""

    def __post_init__(self) -> None:
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in SCHEMES:
                raise ValueError(f"state store URL scheme must be one of {', '.join(SCHEMES)}, got {parts.scheme!r}")
            if parts.password is not None:
                raise ValueError("the state store URL carries a password; put it in --state-store-password-file")
        if self.unreachable not in UNREACHABLE:
            raise ValueError(f"unreachable must be one of {', '.join(UNREACHABLE)}, got {self.unreachable!r}")
        if self.heartbeat_s <= 0 or self.call_timeout_s <= 0:
            raise ValueError("heartbeat_s and call_timeout_s must be > 0")
        if self.lease_s < 2 * self.heartbeat_s:
            raise ValueError(f"lease_s must be at least twice heartbeat_s ({2 * self.heartbeat_s:g}), "
                             f"got {self.lease_s:g}")
        if self.processes < 1 or not 0 <= self.index < self.processes:
            raise ValueError(f"processes must be >= 1 and index in 0..processes-1, got {self.processes}, {self.index}")
        if not NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"namespace must match {NAMESPACE.pattern}, got {self.namespace!r}")

    def password(self) -> str | None:
        """The password in ``password_file`` (None: no file). Raises OSError or ValueError (an empty file)."""
        if not self.password_file:
            return None
        with open(self.password_file, encoding="utf-8") as f:
            secret = f.readline().strip()
        if not secret:
            raise ValueError(f"{self.password_file}: no password on its first line")
        return secret

    def part(self, limit: int) -> int:
        """This process's part of ``limit`` while the store is unreachable (``unreachable``): its 1/N share,
        or 0 when it fails closed."""
        if self.unreachable == "closed":
            return 0
        return limit // self.processes + (self.index < limit % self.processes)
