"""Request builders and metric readers for the e2e tests (one place)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from services.common.images import data_url, make_image


def image_chat(seed: int, text: str = "What is in this picture?", max_tokens: int = 12,
               size: tuple[int, int] = (112, 112)) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, size))}},
        {"type": "text", "text": text}]}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def image_bytes(body: dict) -> bytes:
    """The first image of a chat body built by ``image_chat``."""
    import base64

    for m in body["messages"]:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part.get("type") == "image_url":
                return base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    raise ValueError("no image in this request")


def text_chat(text: str, max_tokens: int = 12) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def post(url: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on a Prometheus endpoint whose labels
    include ``labels`` (all label sets when none are given)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def settled(read, want, timeout: float = 10.0):
    """``read()`` once it equals ``want``, or its last value after ``timeout``
    (assert on it). For counters that trail an answer: the LM can answer
    before the encoder's Encode handler has resumed to count its work."""
    deadline = time.monotonic() + timeout
    while (value := read()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def producer_stats(dep) -> dict[str, float]:
    """Live outbound-pool numbers of a deployment's encoder (TransferService.Stats)."""
    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    with dep.client_security.channel(dep.encoder_addr) as ch:
        info = encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(encoder_pb2.GetInfoRequest(), timeout=5)
    with dep.client_security.channel(info.transfer_endpoint) as ch:
        return dict(encoder_pb2_grpc.TransferServiceStub(ch).Stats(encoder_pb2.StatsRequest(), timeout=5).values)
