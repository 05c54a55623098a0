"""A tenant's quotas from the keys file on the whole gateway (``server.serve``, REST and native gRPC, against
a fake LM): a tenant over its quota is answered 429 with ``Retry-After`` (gRPC: RESOURCE_EXHAUSTED, the
same message) while another tenant is served; one connection holds at most its share of the gRPC readers."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.intake import GRPC_READERS_PER_CONNECTION
from tests.integration.gateway_fakes import wait_until
from tests.integration.gateway_harness import chat, metric
from tests.integration.test_gateway_auth import KEY_A, KEY_B, grpc_chat, keyed_gateway
from tests.integration.test_gateway_start_order import run

pytestmark = pytest.mark.integration

METHOD = "/epd.gateway.v1.GatewayService/ChatCompletion"


def write_keys(path, *lines: dict) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_a_tenant_over_its_max_in_flight_gets_429_with_retry_after_on_rest_and_grpc_while_another_is_served(tmp_path):
    keys = write_keys(tmp_path / "keys.jsonl", {"tenant": "a", "key": KEY_A, "max_in_flight": 1},
                      {"tenant": "b", "key": KEY_B})

    async def body():
        async with keyed_gateway(api_keys_file=keys, lm_max_outstanding=8) as (gw, lm):
            lm.world.lm_script.append("block")  # a's first request holds its one place until cancelled
            holder = asyncio.create_task(gw.post("/v1/chat/completions", chat("a1"),
                                                 {"Authorization": f"Bearer {KEY_A}"}))
            await wait_until(lambda: lm.requests, 20, "a's first request at the LM")
            status, err, headers = await gw.post("/v1/chat/completions", chat("a2"),
                                                 {"Authorization": f"Bearer {KEY_A}"})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert err["error"]["type"] == "rate_limit_error" and err["error"]["code"] == 429
            assert "tenant a" in err["error"]["message"] and "max_in_flight" in err["error"]["message"]
            stub = gateway_pb2_grpc.GatewayServiceStub(gw.channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anext(aiter(stub.ChatCompletion(gateway_pb2.OpenAIRequest(body=json.dumps(chat()).encode()),
                                                      metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=10)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details() == err["error"]["message"]
            # b is served on both APIs meanwhile: the deployment has room, only a is over its quota.
            status, out, _ = await gw.post("/v1/chat/completions", chat("b1"), {"Authorization": f"Bearer {KEY_B}"})
            assert status == 200, out
            assert await grpc_chat(gw, KEY_B) == grpc.StatusCode.OK
            assert await metric(gw, "epd_gateway_admission_total", outcome="refused_quota") >= 2
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await gw.poll(lambda: metric(gw, "epd_gateway_admission_in_flight", holds="lm"), lambda v: v == 0, 20,
                          "a's first request's place given back")
            status, _, _ = await gw.post("/v1/chat/completions", chat("a3"), {"Authorization": f"Bearer {KEY_A}"})
            assert status == 200  # its place back, a is served again

    run(body)


def test_one_connection_holds_at_most_its_share_of_the_grpc_readers_and_another_connection_is_read():
    """Without keys (one tenant): calls whose message never comes, all on one connection, take at most
    ``GRPC_READERS_PER_CONNECTION`` readers; the next waits for one of them and is refused, and another
    connection is served."""

    async def body():
        async with keyed_gateway(body_timeout_s=20.0) as (gw, lm):
            stalled = [gw.channel.stream_stream(METHOD)() for _ in range(GRPC_READERS_PER_CONNECTION)]
            await gw.poll(lambda: metric(gw, "epd_gateway_bodies_reading"),
                          lambda v: v >= GRPC_READERS_PER_CONNECTION, 20, "the stalled calls hold their readers")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gw.channel.stream_stream(METHOD)().read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "connection" in e.value.details()
            async with gw.connection() as other:
                stub = gateway_pb2_grpc.GatewayServiceStub(other)
                answers = [m async for m in stub.ChatCompletion(
                    gateway_pb2.OpenAIRequest(body=json.dumps(chat(stream=True)).encode()), timeout=10)]
                assert any(m.body for m in answers)
            for call in stalled:
                call.cancel()

    run(body)
