"""What the gateway's pages tell whom: the whole gateway (``server.serve``) against a fake encoder and
a fake LM. Its public /metrics and /health tell a caller nothing of where instances live or what is
cached (no routing decision, no address), while its internal metrics port shows both; a metrics port
guarded as beyond loopback takes only scrapers with a client certificate and the token. Every wait is
a poll with a bounded deadline; ports are the OS's choice or ``free_port``'s."""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
import pytest

from peerauth import SecurityConfig
from services.certs import make_certs, make_token
from services.common.metrics_port import Exposure, MetricsPort
from services.gateway.config import GatewayConfig
from services.gateway.server import serve
from services.up import free_port
from tests.integration.gateway_fakes import FakeEncoder, FakeLM, World, serve_fake
from tests.integration.gateway_harness import Gateway
from tools.media import data_url, make_image

pytestmark = pytest.mark.integration

TEST_LIMIT_S = 120.0  # a hang guard
ROUTING = ("epd_gateway_encoder_routing_total", "epd_gateway_lm_routing_total")


def image_chat() -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(7, (16, 16)))}},
        {"type": "text", "text": "what is it?"}]}], "max_tokens": 3}


async def text_of(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as r:
        return r.status, await r.text()


def test_public_metrics_and_health_show_no_routing_decision_and_no_address_while_the_internal_port_shows_both():
    async def body():
        world = World()
        servers = [await serve_fake(FakeLM("lm", world)), await serve_fake(FakeEncoder("enc", world, 0.5))]
        (_, lm_addr), (_, enc_addr) = servers
        internal = f"http://127.0.0.1:{free_port()}"
        try:
            async with Gateway(lms=lm_addr, encoders=enc_addr, epd_facts=False,
                               metrics_port=int(internal.rsplit(":", 1)[1])) as gw:
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 30, "the LM admitted")
                await gw.poll(lambda: text_of(gw.http, internal + "/health"),
                              lambda r: f'"{enc_addr}": true' in r[1], 30, "the encoder admitted")
                for _ in range(2):  # the same image twice: the second one is routed to what holds it
                    status, answer, _ = await gw.post("/v1/chat/completions", image_chat())
                    assert status == 200, answer
                status, public = await text_of(gw.http, gw.url + "/metrics")
                assert status == 200 and 'epd_gateway_requests_total{route="chat",status="200"}' in public
                for hidden in (*ROUTING, "epd_gateway_instance_", "epd_gateway_stage_seconds", lm_addr, enc_addr):
                    assert hidden not in public, hidden
                status, health = await text_of(gw.http, gw.url + "/health")
                assert status == 200 and lm_addr not in health and enc_addr not in health

                status, everything = await text_of(gw.http, internal + "/metrics")
                assert status == 200 and all(f"{name}{{decision=" in everything for name in ROUTING)
                assert f'epd_gateway_instance_calls_total{{instance="{enc_addr}",role="encoder"}}' in everything
                status, health = await text_of(gw.http, internal + "/health")
                assert status == 200 and lm_addr in health and enc_addr in health
        finally:
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def test_a_gateway_refuses_an_internal_port_beyond_loopback_without_tls_and_authentication_before_it_listens():
    cfg = GatewayConfig(lms="127.0.0.1:1", port=0, metrics_port=free_port(), metrics_host="0.0.0.0")
    listened = []
    with pytest.raises(ValueError, match="the metrics port"):
        asyncio.run(asyncio.wait_for(serve(cfg, on_listening=lambda *ports: listened.append(ports)), TEST_LIMIT_S))
    assert not listened


def test_a_guarded_metrics_port_takes_only_scrapers_with_a_client_certificate_and_the_token(tmp_path):
    sec = make_certs(str(tmp_path / "tls"), ["localhost", "127.0.0.1"])
    security = SecurityConfig(**sec, auth_token_file=make_token(str(tmp_path / "token")))
    with_cert = ssl.create_default_context(cafile=sec["tls_ca"])
    with_cert.load_cert_chain(sec["tls_cert"], sec["tls_key"])
    without_cert = ssl.create_default_context(cafile=sec["tls_ca"])
    bearer = {"Authorization": f"Bearer {security.token}"}

    async def scrape(http: aiohttp.ClientSession, url: str, context, headers=None) -> int:
        try:
            async with http.get(url, ssl=context, headers=headers or {}) as r:
                return r.status if r.status != 200 or "# TYPE" in await r.text() else 0
        except aiohttp.ClientError:
            return -1  # refused on the connection: no TLS, or no client certificate

    async def body():
        port = MetricsPort("127.0.0.1", 0, Exposure.guarded(security))  # as beyond loopback
        n = await port.start()
        try:
            async with aiohttp.ClientSession() as http:
                url = f"https://127.0.0.1:{n}/metrics"
                assert await scrape(http, f"http://127.0.0.1:{n}/metrics", None, bearer) == -1
                assert await scrape(http, url, without_cert, bearer) == -1
                assert await scrape(http, url, with_cert) == 401
                assert await scrape(http, url, with_cert, {"Authorization": "Bearer wrong"}) == 401
                assert await scrape(http, url, with_cert, bearer) == 200
        finally:
            await port.stop()

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))
