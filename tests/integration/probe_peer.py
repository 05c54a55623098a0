"""Handshake with a Transfer endpoint from this process and print the chosen
transport (or the error). Run inside another mount namespace by the tests:

    python -m tests.integration.probe_peer HOST:PORT shm,grpc
"""

from __future__ import annotations

import asyncio
import sys

from ectransfer import factory
from services.common.errors import EPDError
from services.lm.peers import PeerChecker
from tests.support.loopback import compat


async def main(endpoint: str, transports: str) -> int:
    checker = PeerChecker(compat(), "probe", [factory.make_consumer(t) for t in transports.split(",")], 10)
    try:
        choice = await checker._handshake(endpoint)
    except EPDError as e:
        print("ERROR", e)
        return 1
    print("CHOSE", choice)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
