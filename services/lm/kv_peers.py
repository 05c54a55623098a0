"""Who may have an answer from this LM's NIXL side channel: the deployment's engines, nobody else.

vLLM's handshake carries no credential (a decode engine sends three msgpack values and reads the
answer), and it is vLLM's code on the dialing side, so the proof has to come from the connection
itself. ``PeerCheck`` decides per connection (``HandshakeListener`` asks it for every message):

- **A process on this host** (its end of the TCP connection is in the kernel's socket table,
  ``/proc/net/tcp`` and ``tcp6``, of this network namespace): admitted only when it runs as this
  engine's user. The deployment's LMs on one host (``epd up``) run as one user; another local user
  dialing loopback gets nothing.
- **A peer on another host** (or in another network namespace: another pod): admitted when its
  address is in ``--kv-peers`` (addresses and CIDRs), or, with that list empty, whenever it reaches
  the port (only possible with ``--insecure-kv-side-channel``, where the network keeps everyone else
  off it). A loopback address that is not in the table is refused: it can only be a closed socket.

What it cannot prove: that a remote address is not spoofed by someone on the path, and anything about
UCX's own ports (the transfers themselves), which vLLM opens and we do not bind. ``to_dict`` and
``from_dict`` carry the settings into the EngineCore in ``kv_connector_extra_config``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

Address = tuple[str, int]
Owner = Callable[[Address, Address], int | None]
"""``owner(peer, local)``: the uid of the process whose socket is ``peer`` connected to ``local``, None
when that socket is not on this host (in this network namespace)."""

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
EXTRA_KEY = "side_channel"
"""``kv_connector_extra_config`` key of the settings (``to_dict``), read in the EngineCore."""


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address with IPv4-mapped IPv6 read as IPv4 (a v6 socket sees a v4 peer as ``::ffff:a.b.c.d``)."""
    addr = ipaddress.ip_address(host.strip("[]").split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _table_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """One ``ADDR:PORT`` of ``/proc/net/tcp*``: the address as the kernel's 32-bit words in host order
    (little-endian here), the port in hex."""
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _ip(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)), int(port, 16)


def socket_owner(peer: Address, local: Address, tables: tuple[str, ...] = TABLES) -> int | None:
    """The uid owning the socket whose local end is ``peer`` and remote end ``local`` in the kernel's TCP
    tables; None when no such socket is listed (a remote peer, or one that closed)."""
    want = ((_ip(peer[0]), peer[1]), (_ip(local[0]), local[1]))
    for path in tables:
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 7 and (_table_address(cols[1]), _table_address(cols[2])) == want:
                return int(cols[7])
    return None


def parse_peers(spec: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``--kv-peers``: comma-separated addresses and CIDRs (names are not taken: the check compares the
    connection's address, and a name's address is DNS's to change). Raises ValueError naming the bad one."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        try:
            out.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            raise ValueError(f"--kv-peers: {entry!r} is not an address or a CIDR (allowed: addresses such as "
                             f"10.0.0.7 or fd00::7, and CIDRs such as 10.0.0.0/24)") from None
    return out


@dataclass
class PeerCheck:
    """See the module docstring. ``uid``: the user the deployment runs as (this process's); ``owner``
    replaces the socket-table lookup (tests)."""

    peers: list = field(default_factory=list)
    """Remote addresses admitted (networks); empty: any remote peer that reaches the port."""
    uid: int = field(default_factory=os.geteuid)
    owner: Owner = socket_owner

    def __call__(self, peer: Address, local: Address) -> str | None:
        """None when ``peer`` may have an answer, else why not."""
        uid = self.owner(peer, local)
        if uid is not None:
            return None if uid == self.uid else f"{peer[0]}:{peer[1]} is a process of uid {uid} on this host, " \
                                                 f"not of the deployment's ({self.uid})"
        addr = _ip(peer[0])
        if addr.is_loopback:
            return f"{peer[0]}:{peer[1]} is not in this host's socket table"
        if self.peers and not any(addr in net for net in self.peers):
            return f"{peer[0]} is not in --kv-peers"
        return None

    def to_dict(self) -> dict:
        """The settings for ``kv_connector_extra_config`` (JSON; the uid is the engine's own)."""
        return {"peers": ",".join(str(n) for n in self.peers)}

    @classmethod
    def from_dict(cls, d: dict) -> PeerCheck:
        return cls(peers=parse_peers(str(d.get("peers", ""))))
