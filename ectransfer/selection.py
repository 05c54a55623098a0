"""Choosing a transport by capability, not by hostname.

The consumer walks its own preference list (best first) and takes the first
transport the producer offers whose probe succeeds here: shared memory only if
this process can map the producer's segment and read its nonce back (a separate
mount or IPC namespace cannot), CUDA IPC only if the handle opens. A list of
one transport forces it: if it cannot be used the handshake fails with the
reason instead of falling back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ectransfer.base import ConsumerTransport
from ectransfer.factory import transport_name
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2


@dataclass
class Choice:
    transport: ConsumerTransport
    proof: bytes
    skipped: list[str] = field(default_factory=list)  # why better transports were not used
    offer: transfer_pb2.TransportOffer | None = None  # the producer's offer that was chosen
    lane_secret: bytes = b""  # from the producer's Selected: opens one control-lane connection for this stream

    @property
    def name(self) -> str:
        return transport_name(self.transport.kind)

    @property
    def fell_back(self) -> bool:
        return bool(self.skipped)


def choose(offers: list[transfer_pb2.TransportOffer], preference: list[ConsumerTransport]) -> Choice:
    by_kind = {o.transport: o for o in offers}
    skipped: list[str] = []
    for t in preference:
        name = transport_name(t.kind)
        offer = by_kind.get(t.kind)
        if offer is None:
            skipped.append(f"{name}: not offered by the encoder")
            continue
        try:
            return Choice(t, t.probe(offer), skipped, offer)
        except ProtocolError as e:
            skipped.append(f"{name}: {e}")
    forced = " (forced)" if len(preference) == 1 else ""
    raise ProtocolError(f"no usable transport{forced}: " + "; ".join(skipped))
