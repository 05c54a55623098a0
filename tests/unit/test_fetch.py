"""Image URL rules without a network: the SSRF guard's address checks, URL validation, the
resolver filter, the header check (decompression bombs) and the gRPC API's conversion."""

import asyncio
import ipaddress
import json
import socket

import grpc
import pytest

from epd.gateway.v1 import gateway_pb2
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput, EPDError, MediaError
from services.common.media_checks import IMAGE_FORMATS, check_image
from services.gateway.config import GatewayConfig
from services.gateway.fetch import (
    GuardResolver,
    HostRefused,
    MediaFetcher,
    address_refusal,
    check_format,
    check_url,
    decode_data_url,
    load_images,
    sniff_image_format,
)
from services.gateway.servicer import GatewayServicer
from tests.unit.helpers import data_url, image_bytes
from tools.media import bomb_png

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="x:1")
NETS = GatewayConfig(lms="x:1", fetch_allow_networks="127.0.0.0/8, 10.1.0.0/16").allowed_networks
ip = ipaddress.ip_address


@pytest.mark.parametrize("addr, reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.0.0.1", "private"), ("192.168.1.5", "private"),
    ("172.16.0.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("100.64.0.1", "non-global"), ("fd00::1", "private"), ("240.0.0.1", "private"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"), ("2002:0a00:0001::", "private"),
    ("8.8.8.8", None), ("2606:4700:4700::1111", None), ("::ffff:8.8.8.8", None),
    # IPv6 ranges Python's tables miss or that embed an IPv4 address
    ("fec0::1", "site-local"), ("feff::1", "site-local"), ("fc00::1", "private"), ("3fff::1", "documentation"),
    ("::10.0.0.1", "IPv4-compatible"), ("::8.8.8.8", "IPv4-compatible"),
    ("64:ff9b::10.0.0.1", "private"), ("64:ff9b::127.0.0.1", "loopback"), ("64:ff9b::8.8.8.8", None),
    ("64:ff9b:1::a00:1", "local-use NAT64"), ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "Teredo"),
    ("2002:7f00:1::", "loopback"), ("2002:a9fe:a9fe::", "link-local"), ("2002:808:808::", None),
    ("::ffff:0:10.0.0.1", "reserved"),
], ids=str)
def test_address_refusal_by_default(addr, reason):
    assert address_refusal(ip(addr), []) == reason


def test_allow_list_admits_only_its_networks_including_ipv4_mapped_forms():
    assert address_refusal(ip("127.0.0.1"), NETS) is None
    assert address_refusal(ip("::ffff:127.0.0.1"), NETS) is None
    assert address_refusal(ip("10.1.2.3"), NETS) is None
    assert address_refusal(ip("10.0.0.1"), NETS) == "private"
    assert address_refusal(ip("::1"), NETS) == "loopback"


@pytest.mark.parametrize("url, needle", [
    ("http://127.0.0.1/x.png", "host 127.0.0.1 is a loopback address; refused (SSRF guard"),
    ("http://10.0.0.1/x.png", "host 10.0.0.1 is a private address"),
    ("http://169.254.169.254/latest/meta-data/", "host 169.254.169.254 is a link-local address"),
    ("http://[::1]:8080/x.png", "host ::1 is a loopback address"),
    ("http://[::ffff:10.0.0.1]/x.png", "is a private address"),
    ("http://[fec0::1]/x.png", "host fec0::1 is a site-local address"),
    ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "is a link-local address"),
    ("http://2130706433/x.png", "not a canonical IP address"),
    ("http://127.1/x.png", "not a canonical IP address"),
    ("http://0x7f.0.0.1/x.png", "not a canonical IP address"),
    ("file:///etc/passwd", "scheme 'file' is not allowed"),
    ("ftp://example.com/a.png", "scheme 'ftp' is not allowed"),
    ("gopher://example.com/", "scheme 'gopher' is not allowed"),
    ("http:///x.png", "has no host"),
], ids=str)
def test_check_url_refuses_without_a_network(url, needle):
    with pytest.raises(MediaError, match=None) as e:
        check_url(url, [])
    assert needle in str(e.value) and e.value.status == 400


def test_check_url_passes_names_through_and_literals_in_the_allow_list():
    assert check_url("https://example.com/cat.png", []).host == "example.com"  # the resolver checks names
    assert check_url("http://127.0.0.1:9/x.png", NETS).port == 9
    with pytest.raises(MediaError, match="10.0.0.1 is a private address"):
        check_url("http://10.0.0.1/x.png", NETS)


class _FakeResolver:
    def __init__(self, *addrs):
        self.addrs = addrs

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": 0} for a in self.addrs]

    async def close(self):
        pass


def _resolve(allowed, *addrs):
    async def go():
        r = GuardResolver(allowed)
        r._inner = _FakeResolver(*addrs)
        return await r.resolve("img.example", 80)
    return asyncio.run(go())


def test_resolver_drops_non_public_addresses_and_keeps_public_ones():
    assert [r["host"] for r in _resolve([], "10.0.0.7", "93.184.216.34", "::1")] == ["93.184.216.34"]


def test_resolver_refuses_a_name_with_only_non_public_addresses():
    with pytest.raises(HostRefused) as e:
        _resolve([], "127.0.0.1", "169.254.169.254")
    msg = str(e.value)
    assert "img.example" in msg and "127.0.0.1 is loopback" in msg and "169.254.169.254 is link-local" in msg
    assert "SSRF guard" in msg


def test_resolver_keeps_allowed_networks():
    assert [r["host"] for r in _resolve(NETS, "127.0.0.1", "10.0.0.1")] == ["127.0.0.1"]


def test_check_image_reads_the_header_and_refuses_bombs_and_unknown_formats():
    assert check_image(image_bytes("PNG", size=(8, 6)), 100) == ("PNG", 8, 6)
    assert check_image(image_bytes("JPEG", size=(8, 6)), 100)[0] == "JPEG"
    with pytest.raises(MediaError, match=r"8x6 = 48 pixels, more than the 47 allowed"):
        check_image(image_bytes("PNG", size=(8, 6)), 47)
    with pytest.raises(MediaError, match="decompression.bomb"):
        check_image(bomb_png(10000), CFG.max_image_pixels)  # 100 M pixels: over our 64 M
    with pytest.raises(MediaError, match="decompression.bomb"):
        check_image(bomb_png(), CFG.max_image_pixels)  # 400 M: PIL's own guard fires first
    with pytest.raises(MediaError, match="not a recognised image"):
        check_image(b"%!PS-Adobe-3.0 EPSF-3.0\n", CFG.max_image_pixels)  # EPS would run Ghostscript
    with pytest.raises(MediaError, match="empty"):
        check_image(b"", 100)


@pytest.mark.parametrize("fmt", [*IMAGE_FORMATS, "MPO"])
def test_every_accepted_format_loads(fmt):
    """Every format of the one list (``IMAGE_FORMATS``) has a signature the gateway sniffs."""
    data = image_bytes(fmt)
    assert asyncio.run(load_images([data], CFG, None)) == [data]
    assert check_format(data, 100) == ("JPEG" if fmt == "MPO" else fmt)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "TGA", "JPEG2000", "PCX", "SGI"])
def test_formats_outside_the_allow_list_are_refused_with_400(fmt):
    with pytest.raises(MediaError, match="not a recognised image of an accepted format") as e:
        asyncio.run(load_images([image_bytes(fmt)], CFG, None))
    assert e.value.status == 400 and "accepted: PNG, JPEG, WEBP, GIF, BMP" in str(e.value)


def test_a_signature_alone_is_not_enough():
    """The first bytes pick the format; the header must then parse as that format."""
    assert sniff_image_format(b"\x89PNG\r\n\x1a\n" + b"junk" * 8) == "PNG"
    with pytest.raises(MediaError, match="not a recognised image"):
        check_format(b"\x89PNG\r\n\x1a\n" + b"junk" * 8, 100)
    assert sniff_image_format(b"BM") is None and sniff_image_format(b"") is None


def test_bomb_png_is_small_and_claims_its_size():
    data = bomb_png(10000)
    assert len(data) < 100_000
    assert check_image(data, 10**9) == ("PNG", 10000, 10000)


def test_data_url_over_the_limit_is_413():
    with pytest.raises(MediaError) as e:
        decode_data_url("data:image/png;base64," + "A" * 4000, 1000)
    assert e.value.status == 413 and isinstance(e.value, BadInput)


def test_load_images_without_a_fetcher_refuses_http_and_raw_bytes_are_checked():
    png = image_bytes("PNG")
    assert asyncio.run(load_images([png], CFG, None)) == [png]
    with pytest.raises(MediaError, match="no media fetcher"):
        asyncio.run(load_images(["http://example.com/a.png"], CFG, None))
    with pytest.raises(MediaError, match="more than the"):
        asyncio.run(load_images([bomb_png(10000)], CFG, None))


def test_fetcher_refuses_guarded_urls_before_opening_a_session():
    async def go(url):
        f = MediaFetcher(CFG)
        try:
            with pytest.raises(MediaError) as e:
                await f.fetch(url)
            assert f._session is None  # refused before any client (so before any connection)
            return str(e.value)
        finally:
            await f.close()
    assert "10.0.0.1 is a private address" in asyncio.run(go("http://10.0.0.1/a.png"))
    assert "scheme 'file'" in asyncio.run(go("file:///etc/passwd"))


class _FakeOrch:
    """Stands in for the Orchestrator: records what reached it and answers like an LM that found no
    encoder for the items (one whole body, then the last message)."""

    def __init__(self):
        from services.gateway.admission import Admission

        self.calls = []
        self.admission = Admission(0, 0, 0, 1.0, lambda: 1, lambda: 1)  # off
        self.lms = None  # no background request is held here

    def generating_lms(self) -> int:
        return 1

    def lm_wait_reason(self):
        return None

    def encodes_remotely(self, n_media: int) -> bool:
        return False

    async def generate(self, req, media, timings, body=None, ticket=None, lm=None, disaggregate=True):
        if body is not None:
            req.openai.body = body.render(req, media)
        # What reached the LM, as it was then (the servicer drops the payload once answered).
        self.calls.append((type(req).FromString(req.SerializeToString()), list(media)))
        yield lm_pb2.GenerateResponse(request_id=req.request_id, http_status=200, openai=b'{"object": "chat.completion"}')
        yield lm_pb2.GenerateResponse(request_id=req.request_id, finish_reason="stop", timings=lm_pb2.Timings())


class _Context:
    """The part of a grpc.aio servicer context the gateway's servicer reads."""

    def invocation_metadata(self):
        return ()


def _grpc_request(*images: str | bytes) -> gateway_pb2.OpenAIRequest:
    """A gRPC chat request with one image part per image (a URL, or raw bytes sent as media) and a text part."""
    media, parts = [], []
    for img in images:
        if isinstance(img, bytes):
            media.append(img)
            img = f"epd-media:{len(media) - 1}"
        parts.append({"type": "image_url", "image_url": {"url": img}})
    parts.append({"type": "text", "text": "hi"})
    body = {"messages": [{"role": "user", "content": parts}]}
    return gateway_pb2.OpenAIRequest(body=json.dumps(body).encode(), media=media)


def _grpc_call(svc: GatewayServicer, request: gateway_pb2.OpenAIRequest) -> list[gateway_pb2.OpenAIResponse]:
    async def go():
        return [r async for r in svc.ChatCompletion(request, _Context())]
    return asyncio.run(go())


def test_grpc_api_loads_media_bytes_and_refuses_guarded_urls_as_bad_input():
    orch = _FakeOrch()
    svc = GatewayServicer(GatewayConfig(lms="x:1", epd_facts=True), orch=orch, fetcher=MediaFetcher(CFG))
    png = image_bytes("PNG")
    out = _grpc_call(svc, _grpc_request(png))
    assert json.loads(out[0].body) == {"object": "chat.completion"} and json.loads(out[-1].epd)["retries"] == 0
    (req, media), = orch.calls
    assert [m.data for m in media] == [png]
    assert [(i.modality, i.identifier) for i in req.items] == [("image", media[0].identifier)]
    # No encoder laid it out: the LM gets the bytes the gateway read as a data: URL, in the part's place.
    content = json.loads(req.openai.body)["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"]
    assert content[0]["image_url"]["url"] == data_url(png)
    with pytest.raises(EPDError) as e:
        _grpc_call(svc, _grpc_request("http://169.254.169.254/"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "link-local" in str(e.value)
    with pytest.raises(EPDError, match="decompression.bomb") as e:
        _grpc_call(svc, _grpc_request(bomb_png(10000)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(orch.calls) == 1  # refused images never reach the LM


def test_grpc_api_refuses_a_media_ref_that_names_nothing_as_invalid_argument():
    orch = _FakeOrch()
    svc = GatewayServicer(CFG, orch=orch)
    req = _grpc_request(image_bytes("PNG"))
    del req.media[:]
    with pytest.raises(EPDError) as e:
        _grpc_call(svc, req)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'epd-media:0' names no media item" in str(e.value)
    with pytest.raises(EPDError, match="no media fetcher") as e:  # http(s) needs the server's fetcher
        _grpc_call(svc, _grpc_request("https://example.com/cat.png"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert orch.calls == []
