"""Message-layout versions of the services' gRPC packages (docs/protocol.md, "Versioning").

A package (``epd.encoder.v1``) only grows within its version; where a message's layout changed in a
way an older peer would misread, the service's ``GetInfo`` says which layout it speaks, and the
caller refuses a peer with another one before sending it work. Owned here, read by the encoder
(which reports it) and the gateway (which checks it).
"""

from __future__ import annotations

# 2: ItemMetadata carries the transfer library's ItemSource (epd.transfer.v1) instead of its fields
# one by one, and the Transfer service is epd.transfer.v1.TransferService. 0: an encoder older
# than that (the field did not exist).
ENCODER_PROTOCOL = 2


def encoder_protocol_problem(reported: int) -> str | None:
    """Why an encoder whose ``EncoderInfo.protocol`` is ``reported`` cannot serve this gateway, or None."""
    if reported == ENCODER_PROTOCOL:
        return None
    older = "an older" if reported < ENCODER_PROTOCOL else "a newer"
    return (f"speaks encoder protocol {reported}, this gateway protocol {ENCODER_PROTOCOL} "
            f"({older} epd-serve; run one version across the deployment)")
