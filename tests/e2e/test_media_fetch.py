"""Issue 5: image URLs are fetched once by the gateway, within limits.

Default-deny through the session deployment's gateway (curl, the openai client, the native gRPC
API): loopback, private, link-local and file: URLs answer 400 with a message naming the SSRF guard,
quickly, without the gateway connecting anywhere. Then a second gateway on the same encoder and LM,
started with ``--fetch-allow-networks 127.0.0.0/8``, fetches from a local image server: the same
tokens as the data: URL, 413 for 50 MB, 400 for a decompression bomb, 4xx for a slow server."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time

import grpc
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.probe import http_ok
from services.up import Service, free_port, wait_ready
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import post
from tests.integration.media_server import MediaServer

pytestmark = pytest.mark.e2e

FETCH_TIMEOUT_S = 5.0
"""The fetching gateway's --fetch-timeout-s: the whole fetch (every good one here, and the 20 MB read
before a 413, within it on a loaded host); /slow answers after 60 s."""
GUARD = "refused (SSRF guard; see --fetch-allow-networks)"


def with_image_url(url: str) -> dict:
    """REFERENCE_REQUESTS["image0"] with its data: URL replaced by ``url``."""
    body = copy.deepcopy(REFERENCE_REQUESTS["image0"])
    body["messages"][0]["content"][0]["image_url"]["url"] = url
    return body


@pytest.fixture(scope="module")
def media_server():
    s = MediaServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fetch_gateway(deployment):
    """A second gateway on the deployment's encoder and LM that may fetch from loopback."""
    port = free_port()
    svc = Service("gateway-fetch", ["gateway", "--epd-facts", "--host", "127.0.0.1", "--port", str(port),
                                    "--encoders", deployment.encoder_addr, "--lms", deployment.lm_addr,
                                    "--fetch-allow-networks", "127.0.0.0/8",
                                    "--fetch-timeout-s", str(FETCH_TIMEOUT_S), *deployment.security_args],
                  os.path.join(deployment.log_dir, "gateway-fetch.log"))
    svc.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready({svc: lambda: http_ok(url + "/health")}, time.monotonic() + 120, poll_s=0.3)
        yield url
    finally:
        svc.stop()


DENIED = {
    "loopback": ("http://127.0.0.1:{port}/good.png", "127.0.0.1 is a loopback address; " + GUARD),
    "private": ("http://10.0.0.1/cat.png", "10.0.0.1 is a private address; " + GUARD),
    "metadata": ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address; " + GUARD),
    "localhost": ("http://localhost:{port}/good.png", "localhost resolves only to non-public addresses"),
    "file": ("file:///etc/passwd", "scheme 'file' is not allowed"),
}


@pytest.mark.parametrize("case", list(DENIED))
def test_default_gateway_refuses_with_curl(deployment, media_server, case):
    url, needle = DENIED[case]
    body = json.dumps(with_image_url(url.format(port=media_server.port)))
    before = media_server.hits["/good.png"]
    t0 = time.monotonic()
    out = subprocess.run(["curl", "-sS", "--noproxy", "*", "--max-time", "30", "-w", "\n%{http_code}",
                          "-H", "Content-Type: application/json", "-d", body,
                          deployment.url + "/v1/chat/completions"], capture_output=True, text=True, check=True)
    text, _, code = out.stdout.rpartition("\n")
    assert time.monotonic() - t0 < 10
    error = json.loads(text)["error"]
    assert code == "400" and error["param"] == "image_url" and needle in error["message"], out.stdout
    assert media_server.hits["/good.png"] == before  # the gateway never reached the local server


@pytest.mark.parametrize("case", ["loopback", "private", "metadata", "file"])
def test_default_gateway_refuses_with_the_openai_client(client, media_server, case):
    import openai

    url, needle = DENIED[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url.format(port=media_server.port)}},
            {"type": "text", "text": "hi"}]}])
    assert e.value.status_code == 400 and needle in e.value.message


def test_default_gateway_refuses_over_native_grpc(deployment):
    req = gateway_pb2.OpenAIRequest(body=json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]}).encode())
    with grpc.insecure_channel(deployment.gateway_grpc) as ch, pytest.raises(grpc.RpcError) as e:
        list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and GUARD in e.value.details()


def test_an_http_image_gives_the_same_tokens_as_its_data_url(fetch_gateway, media_server, reference):
    before = media_server.hits["/good.png"]
    status, body = post(fetch_gateway + "/v1/chat/completions", with_image_url(media_server.url("/good.png")))
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["image0"]
    assert media_server.hits["/good.png"] == before + 1  # fetched once, by the gateway


def test_an_http_image_after_a_redirect_and_by_name(fetch_gateway, media_server, reference):
    url = media_server.url("/redirect/2", host="localhost")  # localhost -> 127.0.0.1, allowed here
    status, body = post(fetch_gateway + "/v1/chat/completions", with_image_url(url))
    assert status == 200 and body["choices"][0]["token_ids"] == reference["image0"], body


@pytest.mark.parametrize("path, code, needle", [
    ("/big", 413, "more than the 20971520 allowed (--max-image-bytes)"),
    ("/chunked", 413, "sent more than the 20971520 bytes allowed"),
    ("/bomb.png", 400, "decompression bomb"),
    ("/text", 400, "Content-Type 'text/html', expected image/*"),
    ("/redirect/9", 400, "redirected more than 3 times"),
    ("/slow", 400, f"not fetched within {FETCH_TIMEOUT_S:g} s"),
])
def test_refused_fetches_are_4xx_with_a_reason(fetch_gateway, media_server, path, code, needle):
    t0 = time.monotonic()
    status, body = post(fetch_gateway + "/v1/chat/completions", with_image_url(media_server.url(path)))
    assert time.monotonic() - t0 < FETCH_TIMEOUT_S + 20  # /slow: given up at the timeout, not after its 60 s
    assert status == code and needle in body["error"]["message"], body


def test_the_fetching_gateway_still_serves_after_refusals(fetch_gateway, reference):
    status, body = post(fetch_gateway + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200 and body["choices"][0]["token_ids"] == reference["image0"], body
