"""MediaFetcher against a real aiohttp server on 127.0.0.1: limits, redirects, timeouts, and the
SSRF guard refusing before any connection. Every connection the fetcher makes is recorded (the
event loop's ``sock_connect``), and one to anything but loopback fails the test. Then its pool
shared between requests and origins, against two origins of which one holds its connections
(``HeldOrigins``)."""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import pytest

from services.common.errors import MediaError
from services.gateway.config import GatewayConfig
from services.gateway.fetch import (
    FETCH_CONNECTIONS,
    FETCH_CONNECTIONS_PER_HOST,
    FETCHES_PER_REQUEST,
    MediaFetcher,
    load_images,
)
from tests.integration.held_origins import HeldOrigins
from tests.integration.media_server import MediaServer
from tools.media import make_audio, make_image

pytestmark = pytest.mark.integration

# A fetch timeout no loopback fetch reaches, however busy the host; the timeout tests set their own.
LOOPBACK_OK = dict(lms="x:1", fetch_allow_networks="127.0.0.0/8", fetch_timeout_s=30.0)


@pytest.fixture(scope="module")
def server():
    s = MediaServer().start()
    yield s
    s.stop()


def fetch(url: str, **cfg) -> tuple[bytes | MediaError, list, float]:
    """Fetches ``url`` with a fresh MediaFetcher on a fresh loop; returns (body or MediaError,
    addresses connected to, seconds taken)."""
    cfg = GatewayConfig(**{**LOOPBACK_OK, **cfg})
    connects: list = []

    async def go():
        loop = asyncio.get_running_loop()
        real = loop.sock_connect

        async def recording(sock, address):
            connects.append(address[0])
            if address[0] not in ("127.0.0.1", "::1"):
                raise AssertionError(f"the fetcher tried to connect to {address}")
            return await real(sock, address)

        loop.sock_connect = recording
        f = MediaFetcher(cfg)
        try:
            return await f.fetch(url)
        except MediaError as e:
            return e
        finally:
            await f.close()

    t0 = time.monotonic()
    out = asyncio.run(go())
    return out, connects, time.monotonic() - t0


def refused(url: str, **cfg) -> tuple[MediaError, list]:
    out, connects, _ = fetch(url, **cfg)
    assert isinstance(out, MediaError), out[:40]
    return out, connects


def test_a_good_png_is_fetched(server):
    out, connects, _ = fetch(server.url("/good.png"))
    assert out == make_image(0) and connects == ["127.0.0.1"]


def test_redirects_within_the_cap_are_followed(server):
    assert fetch(server.url("/redirect/3"), fetch_max_redirects=3)[0] == make_image(0)


def test_a_redirect_chain_longer_than_the_cap_is_refused(server):
    before = dict(server.hits)
    e, _ = refused(server.url("/redirect/5"), fetch_max_redirects=3)
    assert "redirected more than 3 times" in str(e) and "--fetch-max-redirects" in str(e)
    new = {p: n - before.get(p, 0) for p, n in server.hits.items() if n != before.get(p, 0)}
    assert new == {"/redirect/5": 1, "/redirect/4": 1, "/redirect/3": 1, "/redirect/2": 1}  # 3 redirects followed


@pytest.mark.parametrize("target, needle", [
    ("http://10.0.0.1/x.png", "host 10.0.0.1 is a private address; refused (SSRF guard; see --fetch-allow-networks)"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
    ("file:///etc/passwd", "scheme 'file' is not allowed"),
])
def test_a_redirect_to_a_refused_url_is_checked_before_connecting(server, target, needle):
    e, connects = refused(server.url("/to/" + urllib.parse.quote(target, safe="")))
    assert needle in str(e)
    assert connects == ["127.0.0.1"]  # the first hop only


def test_a_redirect_to_a_name_is_resolved_through_the_guard(server):
    hop = urllib.parse.quote(server.url("/good.png", host="localhost"), safe="")
    assert fetch(server.url("/to/" + hop))[0] == make_image(0)  # localhost -> 127.0.0.1, allowed here


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/good.png", "http://10.0.0.1/x.png",
                                 "http://169.254.169.254/latest/meta-data/", "http://[::1]:{port}/good.png",
                                 "http://localhost:{port}/good.png", "file:///etc/passwd"])
def test_the_default_config_refuses_non_public_hosts_without_connecting(server, url):
    e, connects = refused(url.format(port=server.port), fetch_allow_networks="")
    assert connects == []
    assert "scheme 'file'" in str(e) or "refused (SSRF guard; see --fetch-allow-networks)" in str(e)


def test_localhost_refusal_names_the_host_and_its_addresses(server):
    e, _ = refused(server.url("/good.png", host="localhost"), fetch_allow_networks="")
    assert "image URL host localhost resolves only to non-public addresses (127.0.0.1 is loopback" in str(e)


def test_a_large_content_length_is_refused_before_reading(server):
    e, _ = refused(server.url("/big"), max_image_bytes=1 << 20)
    assert e.status == 413 and f"is {50 << 20} bytes, more than the {1 << 20} allowed" in str(e)


def test_a_large_chunked_body_is_abandoned_once_over_the_limit(server):
    e, _ = refused(server.url("/chunked"), max_image_bytes=1 << 20)
    assert e.status == 413 and "sent more than the 1048576 bytes allowed" in str(e)
    time.sleep(0.2)
    assert server.sent["/chunked"] < 20 << 20  # far from the 50 MB the server would send


def test_a_non_image_content_type_is_refused(server):
    e, _ = refused(server.url("/text"))
    assert "Content-Type 'text/html', expected image/*" in str(e)


@pytest.mark.parametrize("code", [404, 500])
def test_a_non_2xx_status_is_refused(server, code):
    e, _ = refused(server.url(f"/status/{code}"))
    assert f"answered HTTP {code}" in str(e)


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_a_slow_server_times_out_as_a_whole(server, path):
    out, _, took = fetch(server.url(path), fetch_timeout_s=1.0)
    assert isinstance(out, MediaError) and "not fetched within 1 s (--fetch-timeout-s)" in str(out)
    assert took < 15  # the whole fetch's timeout, not one per read (/trickle's image takes minutes, /slow 60 s)


def test_a_connection_refused_is_a_clear_error(server):
    e, _ = refused("http://127.0.0.1:1/x.png")
    assert "could not be fetched" in str(e)


def test_load_images_fetches_concurrently_and_checks_the_header(server):
    cfg = GatewayConfig(**LOOPBACK_OK)

    async def go(urls):
        f = MediaFetcher(cfg)
        try:
            return await load_images(urls, cfg, f)
        finally:
            await f.close()

    assert asyncio.run(go([server.url("/good.png"), server.url("/redirect/1")])) == [make_image(0)] * 2
    with pytest.raises(MediaError, match="decompression.bomb"):
        asyncio.run(go([server.url("/good.png"), server.url("/bomb.png")]))
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="HTTP 404"):
        asyncio.run(go([server.url("/slow"), server.url("/status/404")]))  # the 404 cancels the slow one
    assert time.monotonic() - t0 < 15  # not the slow one's 30 s fetch timeout (nor its 60 s answer)


def test_audio_urls_are_fetched_under_the_same_guard_with_audio_rules(server):
    """An audio part's URL: audio/* Content-Type, --max-audio-bytes, the header checked as audio; the
    SSRF guard is the same."""
    cfg = GatewayConfig(**LOOPBACK_OK)

    async def go(urls, modalities, c=cfg):
        f = MediaFetcher(c)
        try:
            return await load_images(urls, c, f, modalities)
        finally:
            await f.close()

    clip = make_audio(0, 0.5)
    assert asyncio.run(go([server.url("/clip.wav"), server.url("/good.png")], ["audio", "image"])) == [
        clip, make_image(0)]
    with pytest.raises(MediaError, match="Content-Type 'image/png', expected audio/"):
        asyncio.run(go([server.url("/good.png")], ["audio"]))
    with pytest.raises(MediaError, match="expected image/") as e:
        asyncio.run(go([server.url("/clip.wav")], ["image"]))
    assert e.value.modality == "image"
    with pytest.raises(MediaError, match="--max-audio-bytes") as e:
        asyncio.run(go([server.url("/clip.wav")], ["audio"], GatewayConfig(**LOOPBACK_OK, max_audio_bytes=1000)))
    assert e.value.status == 413 and e.value.modality == "audio"
    with pytest.raises(MediaError, match="private address"):
        asyncio.run(go(["http://10.1.2.3/clip.wav"], ["audio"], GatewayConfig(lms="x:1")))


# --- sharing the fetcher's pool between requests and origins -----------------------------------------------------


def with_origins(test):
    """Runs ``test(origins, fetcher, cfg)`` on a fresh loop with HeldOrigins and one MediaFetcher."""
    cfg = GatewayConfig(**{**LOOPBACK_OK, "fetch_timeout_s": 30.0})

    async def go():
        origins, fetcher = await HeldOrigins().start(), MediaFetcher(cfg)
        try:
            return await test(origins, fetcher, cfg)
        finally:
            await origins.stop()
            await fetcher.close()

    return asyncio.run(go())


def test_one_request_fetches_at_most_its_share_of_urls_at_once():
    async def test(origins, fetcher, cfg):
        request = asyncio.ensure_future(load_images([origins.url(0, f"/hold?i={i}") for i in range(8)], cfg, fetcher))
        await asyncio.wait_for(origins.until_held(0, FETCHES_PER_REQUEST), 10)
        await asyncio.sleep(0.3)  # room for any fetch beyond the share to arrive
        held = origins.in_flight[origins.ports[0]]
        origins.release.set()
        return held, await asyncio.wait_for(request, 10), origins.most[origins.ports[0]]

    held, images, most = with_origins(test)
    assert held == most == FETCHES_PER_REQUEST
    assert images == [make_image(0)] * 8  # the rest waited for a turn and were fetched


def test_a_slow_origin_holds_at_most_its_share_of_the_pool_and_others_are_served():
    """Enough requests at an origin that never answers to fill the whole pool without a per-origin
    limit; a request for another origin is still served while they wait."""
    async def test(origins, fetcher, cfg):
        n = FETCH_CONNECTIONS // FETCHES_PER_REQUEST + 4
        slow = [asyncio.ensure_future(load_images([origins.url(0, f"/hold?r={r}&i={i}") for i in range(8)],
                                                  cfg, fetcher)) for r in range(n)]
        await asyncio.wait_for(origins.until_held(0, FETCH_CONNECTIONS_PER_HOST), 10)
        await asyncio.sleep(0.3)  # room for more of the slow fetches to connect, were they allowed
        other = await asyncio.wait_for(load_images([origins.url(1, "/good.png")], cfg, fetcher), 10)
        held = origins.in_flight[origins.ports[0]]
        assert not any(t.done() for t in slow)
        origins.release.set()
        done = await asyncio.wait_for(asyncio.gather(*slow), 30)
        return other, held, origins.most[origins.ports[0]], done

    other, held, most, done = with_origins(test)
    assert other == [make_image(0)]
    assert held == most == FETCH_CONNECTIONS_PER_HOST
    assert all(images == [make_image(0)] * 8 for images in done)
