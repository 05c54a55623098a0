"""What a client machine does, run inside the multi-host tests' "client" host
(``ip netns exec``), one operation per process; prints one JSON line.

    python -m tests.multihost.client post URL [TIMEOUT] < body.json  {"status", "body", "elapsed_s"}
    python -m tests.multihost.client get URL                          {"status", "text"} (https: as a scraper)
    python -m tests.multihost.client health ADDR [SERVICE]            {"serving"}
    python -m tests.multihost.client stats ENCODER_ADDR               {"values"} (its Transfer Stats RPC)

gRPC operations use the SecurityConfig given as JSON in ``EPD_MH_SECURITY``.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc


def _security():
    from peerauth import SecurityConfig

    return SecurityConfig.from_dict(json.loads(os.environ.get("EPD_MH_SECURITY", "{}")))


def post(url: str, timeout: str = "120") -> dict:
    data = sys.stdin.buffer.read()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=float(timeout)) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except OSError as e:
        return {"status": 0, "body": {"error": repr(e)}, "elapsed_s": time.monotonic() - t0}
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {"raw": body.decode(errors="replace")}
    return {"status": status, "body": parsed, "elapsed_s": time.monotonic() - t0}


def get(url: str) -> dict:
    """An https URL (a service's metrics port on its host's address) is read as Prometheus scrapes it:
    the deployment's CA, client certificate and token."""
    request, context = urllib.request.Request(url), None
    if url.startswith("https:"):
        sec = _security()
        context = ssl.create_default_context(cafile=sec.tls_ca)
        context.load_cert_chain(sec.tls_cert, sec.tls_key)
        if sec.token:
            request.add_header("Authorization", f"Bearer {sec.token}")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as r:
            return {"status": r.status, "text": r.read().decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "text": e.read().decode(errors="replace")}
    except OSError as e:
        return {"status": 0, "text": repr(e)}


def health(address: str, service: str = "") -> dict:
    from services.probe import grpc_serving  # grpc only: no torch (a probe per poll while engines start)

    return {"serving": grpc_serving(address, timeout=2.0, security=_security(), service=service)}


def stats(encoder_addr: str) -> dict:
    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    sec = _security()
    with sec.channel(encoder_addr) as ch:
        info = encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(encoder_pb2.GetInfoRequest(), timeout=30)
    with sec.channel(info.transfer_endpoint) as ch:
        values = transfer_pb2_grpc.TransferServiceStub(ch).Stats(transfer_pb2.StatsRequest(), timeout=30).values
    return {"values": dict(values), "transfer_endpoint": info.transfer_endpoint}


OPS = {"post": post, "get": get, "health": health, "stats": stats}


def main(argv: list[str]) -> int:
    try:
        out = OPS[argv[0]](*argv[1:])
    except Exception as e:  # noqa: BLE001 - reported to the test as data
        out = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
