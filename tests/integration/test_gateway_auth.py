"""Client API keys on the whole gateway (``server.serve``, REST and native gRPC, against a fake LM):
without a known key a guarded REST route answers vLLM's 401 and the gRPC API UNAUTHENTICATED, while
vLLM's open routes answer as before (but /tokenize, which takes media, is guarded); a known key passes on both and names its tenant; SIGHUP reloads
the keys file; no key reaches the log. Also, on a bare gRPC server with the gateway's interceptors,
that a refused call takes nothing from the intake and never reaches the servicer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_server import GrpcServer
from services.gateway.auth import CURRENT_TENANT, UNAUTHORIZED_BODY, GrpcAuth
from services.gateway.config import GatewayConfig
from services.gateway.core import RequestCore
from services.gateway.grpc_intake import GrpcIntake
from services.gateway.intake import Intake
from services.gateway.tenants import ANONYMOUS, DEFAULT, Tenants
from tests.integration.gateway_fakes import FakeLM, World, serve_fake, wait_until
from tests.integration.gateway_harness import Gateway, chat, metric
from tests.integration.test_gateway_start_order import run

pytestmark = pytest.mark.integration

KEY_A = "sk-tenant-a-5f2c9e1d7b"
KEY_B = "sk-tenant-b-8a4e0c3f61"
FLAG_KEY = "sk-flag-3d9b7a2e4c"
GUARDED = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
           ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("POST", "/v1/messages"),
           ("POST", "/inference/v1/generate"), ("GET", "/v1/not-a-route"), ("POST", "/v2/anything")]


def write_keys(path, *pairs: tuple[str, str]) -> str:
    path.write_text("".join(json.dumps({"tenant": t, "key": k}) + "\n" for t, k in pairs))
    return str(path)


@contextlib.asynccontextmanager
async def keyed_gateway(**cfg):
    """A gateway (``Gateway``, with ``cfg``) whose one fake LM is admitted: yields (gateway, lm)."""
    lm = FakeLM("lm-X", World())
    server, addr = await serve_fake(lm)
    try:
        async with Gateway(lms=addr, **cfg) as gw:
            await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the LM is admitted")
            yield gw, lm
    finally:
        await server.stop(0)


async def rest(gw: Gateway, method: str, path: str, key: str | None = None, scheme: str = "Bearer",
               body: dict | None = None) -> tuple[int, bytes]:
    headers = {} if key is None else {"Authorization": f"{scheme} {key}"}
    data = json.dumps(chat() if body is None else body).encode() if method == "POST" else None
    async with gw.http.request(method, gw.url + path, data=data, headers=headers) as r:
        return r.status, await r.read()


async def grpc_chat(gw: Gateway, key: str | None = None, scheme: str = "Bearer",
                    channel: grpc.aio.Channel | None = None) -> grpc.StatusCode:
    """A streaming chat on ``channel`` (default: the gateway harness's)."""
    metadata = None if key is None else (("authorization", f"{scheme} {key}"),)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel or gw.channel)
    try:
        messages = [m async for m in stub.ChatCompletion(
            gateway_pb2.OpenAIRequest(body=json.dumps(chat(stream=True)).encode()), metadata=metadata, timeout=10)]
    except grpc.aio.AioRpcError as e:
        assert e.code() != grpc.StatusCode.UNAUTHENTICATED or e.details() == "Unauthorized"
        return e.code()
    assert any(m.body for m in messages)
    return grpc.StatusCode.OK


@pytest.fixture
def tenants_seen(monkeypatch) -> list[str]:
    """The tenant of every request the request core admitted, in order."""
    seen: list[str] = []
    admit = RequestCore.admit

    async def recording(self, *args, **kwargs):
        admitted = await admit(self, *args, **kwargs)
        seen.append(admitted.tenant)
        return admitted

    monkeypatch.setattr(RequestCore, "admit", recording)
    return seen


def test_guarded_rest_routes_answer_vllms_401_without_a_known_key_and_vllms_open_routes_stay_open(caplog):
    caplog.set_level(logging.DEBUG)

    async def body():
        async with keyed_gateway(api_key=[KEY_A, KEY_B]) as (gw, lm):
            for method, path in GUARDED:
                for key, scheme in ((None, "Bearer"), ("sk-wrong", "Bearer"), (KEY_A, "Basic"), (KEY_A + "x", "Bearer")):
                    assert await rest(gw, method, path, key, scheme) == (401, UNAUTHORIZED_BODY), (method, path, key)
            assert not lm.requests  # nothing refused reached the LM
            for method, path in (("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics")):
                assert (await rest(gw, method, path))[0] == 200, path
            status, _ = await rest(gw, "POST", "/detokenize", body={"tokens": [1]})
            assert status == 200 and len(lm.requests) == 1  # open, as on vllm serve
            # /tokenize takes media: guarded with keys, where vllm serve leaves it open
            assert await rest(gw, "POST", "/tokenize", body={"prompt": "x"}) == (401, UNAUTHORIZED_BODY)
            assert len(lm.requests) == 1
            status, out = await rest(gw, "POST", "/v1/chat/completions", KEY_A)
            assert status == 200 and json.loads(out)["choices"][0]["token_ids"] == [1, 2, 3]
            status, out = await rest(gw, "GET", "/v1/models", KEY_B, scheme="bearer")
            assert status == 200 and json.loads(out)["data"][0]["id"] == "fake-model"

    run(body)
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


def test_the_grpc_api_is_unauthenticated_without_a_known_key_and_serves_with_one_while_health_stays_open(caplog):
    caplog.set_level(logging.DEBUG)

    async def body():
        async with keyed_gateway(api_key=[KEY_A]) as (gw, lm):
            for key, scheme in ((None, "Bearer"), ("sk-wrong", "Bearer"), (KEY_A, "Basic")):
                assert await grpc_chat(gw, key, scheme) == grpc.StatusCode.UNAUTHENTICATED, (key, scheme)
            assert not lm.requests
            health = await health_pb2_grpc.HealthStub(gw.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert await grpc_chat(gw, KEY_A) == grpc.StatusCode.OK and len(lm.requests) == 1

    run(body)
    assert KEY_A not in caplog.text


def test_a_request_carries_the_tenant_its_key_names_on_both_apis(tmp_path, tenants_seen):
    path = write_keys(tmp_path / "keys.jsonl", ("acme", KEY_A), ("lab", KEY_B))

    async def body():
        async with keyed_gateway(api_key=[FLAG_KEY], api_keys_file=path) as (gw, _):
            assert (await rest(gw, "POST", "/v1/chat/completions", KEY_A))[0] == 200
            assert await grpc_chat(gw, KEY_B) == grpc.StatusCode.OK
            assert (await rest(gw, "POST", "/v1/completions", FLAG_KEY, body={"prompt": "x"}))[0] == 200
            assert (await rest(gw, "POST", "/detokenize", body={"tokens": [1]}))[0] == 200  # open, no key
            assert (await rest(gw, "POST", "/tokenize", KEY_B, body={"prompt": "x"}))[0] == 200

    run(body)
    assert tenants_seen == ["acme", "lab", DEFAULT, ANONYMOUS, "lab"]


def test_without_keys_the_gateway_stays_open_and_every_request_is_anonymous(tenants_seen):
    async def body():
        async with keyed_gateway() as (gw, _):
            assert (await rest(gw, "POST", "/v1/chat/completions"))[0] == 200
            assert (await rest(gw, "POST", "/v1/chat/completions", "anything"))[0] == 200
            assert await grpc_chat(gw) == grpc.StatusCode.OK

    run(body)
    assert tenants_seen == [ANONYMOUS] * 3


def test_sighup_reloads_the_keys_file_and_a_file_that_does_not_load_keeps_the_keys(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    keys = tmp_path / "keys.jsonl"
    write_keys(keys, ("acme", KEY_A))

    async def accepted(gw: Gateway) -> tuple[bool, bool]:
        return ((await rest(gw, "POST", "/v1/chat/completions", KEY_A))[0] == 200,
                (await rest(gw, "POST", "/v1/chat/completions", KEY_B))[0] == 200)

    async def body():
        async with keyed_gateway(api_keys_file=str(keys)) as (gw, _):
            assert await accepted(gw) == (True, False)
            write_keys(keys, ("acme", KEY_B))
            assert await accepted(gw) == (True, False)  # read again on SIGHUP only
            os.kill(os.getpid(), signal.SIGHUP)
            await gw.poll(lambda: accepted(gw), lambda r: r == (False, True), 10, "the new key holds")
            assert await grpc_chat(gw, KEY_A) == grpc.StatusCode.UNAUTHENTICATED
            assert await grpc_chat(gw, KEY_B) == grpc.StatusCode.OK
            keys.write_text('{"tenant": "acme", "key": "' + KEY_A)  # half written
            os.kill(os.getpid(), signal.SIGHUP)
            await wait_until(lambda: "not reloaded" in caplog.text, 10, "the failed reload is logged")
            assert await accepted(gw) == (False, True)

    run(body)
    assert "API keys reloaded" in caplog.text
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


class _Recording(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self) -> None:
        self.tenants: list[str] = []

    async def ChatCompletion(self, request, context):
        self.tenants.append(CURRENT_TENANT.get())
        yield gateway_pb2.OpenAIResponse(body=b"{}")


def test_a_refused_grpc_call_takes_nothing_from_the_intake_and_never_reaches_the_servicer(monkeypatch):
    cfg = GatewayConfig(lms="lm:1", max_image_bytes=512 << 10, max_audio_bytes=1 << 20, max_video_bytes=1 << 20,
                        body_memory_mib=32)
    intake, servicer = Intake(cfg), _Recording()
    reservations = []
    reserve = intake.reserve_message

    async def recording_reserve(*args):
        reservations.append(True)
        return await reserve(*args)

    monkeypatch.setattr(intake, "reserve_message", recording_reserve)
    big = gateway_pb2.OpenAIRequest(body=b"x" * (1 << 20))

    async def body():
        server = GrpcServer("127.0.0.1", 0, public=True, interceptors=[GrpcAuth(Tenants([FLAG_KEY])), GrpcIntake(intake)],
                            options={"grpc.max_receive_message_length": cfg.max_body_bytes})
        server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer, "epd.gateway.v1.GatewayService")
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = gateway_pb2_grpc.GatewayServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [m async for m in stub.ChatCompletion(big, timeout=10)]
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert not reservations and not servicer.tenants and intake.budget.used == 0
                out = [m async for m in stub.ChatCompletion(big, timeout=10,
                                                            metadata=(("authorization", f"Bearer {FLAG_KEY}"),))]
                assert len(out) == 1 and reservations and servicer.tenants == [DEFAULT]
        finally:
            await server.stop(0)
        assert intake.budget.used == 0

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_stored_response_belongs_to_the_tenant_that_made_it(tmp_path):
    """Another tenant's GET, cancel and previous_response_id find nothing (vLLM's 404 for an id it has not
    stored), so none can read or continue another's conversation; the owner reaches it."""
    keys = write_keys(tmp_path / "keys.jsonl", ("a", KEY_A), ("b", KEY_B))

    async def body():
        async with keyed_gateway(api_keys_file=keys) as (gw, lm):
            status, raw = await rest(gw, "POST", "/v1/responses", KEY_A, body={"input": "mine"})
            assert status == 200, raw
            rid = json.loads(raw)["id"]
            for method, path, req in [("GET", f"/v1/responses/{rid}", None),
                                      ("POST", f"/v1/responses/{rid}/cancel", {}),
                                      ("POST", "/v1/responses", {"input": "go on", "previous_response_id": rid})]:
                status, raw = await rest(gw, method, path, KEY_B, body=req)
                assert status == 404, (path, raw)
                assert json.loads(raw)["error"]["message"] == f"Response with id '{rid}' not found."
            assert lm.stored[rid] == "completed"  # the stranger's cancel never reached the LM
            status, raw = await rest(gw, "GET", f"/v1/responses/{rid}", KEY_A)
            assert status == 200 and json.loads(raw)["id"] == rid

    run(body)


def test_one_tenants_flood_fills_its_own_queue_and_the_other_tenant_is_served_first(tmp_path):
    """One place, a queue of one per tenant: tenant a holds the place and fills its queue, so its next
    request is refused (429) while tenant b's is queued, and the freed place goes to b before a's waiter."""
    keys = write_keys(tmp_path / "keys.jsonl", ("a", KEY_A), ("b", KEY_B))

    def said(r) -> str:
        return json.loads(r.openai.body)["messages"][0]["content"]

    async def body():
        async with keyed_gateway(api_keys_file=keys, lm_max_outstanding=1, admission_queue=1,
                                 admission_wait_s=30.0) as (gw, lm):
            lm.world.lm_script.append("block")  # a's first request holds the place until cancelled
            holder = asyncio.create_task(rest(gw, "POST", "/v1/chat/completions", KEY_A, body=chat("a1")))
            await wait_until(lambda: lm.requests, 20, "a's first request at the LM")
            a_waiting = asyncio.create_task(rest(gw, "POST", "/v1/chat/completions", KEY_A, body=chat("a2")))
            await gw.poll(lambda: metric(gw, "epd_gateway_admission_waiting"), lambda v: v == 1, 20,
                          "a's second request queued")
            status, raw = await rest(gw, "POST", "/v1/chat/completions", KEY_A, body=chat("a3"))
            assert status == 429, raw  # a's queue is full ...
            b_waiting = asyncio.create_task(rest(gw, "POST", "/v1/chat/completions", KEY_B, body=chat("b1")))
            await gw.poll(lambda: metric(gw, "epd_gateway_admission_waiting"), lambda v: v == 2, 20,
                          "b's request queued beside a's")  # ... b's is not refused
            holder.cancel()  # a's client goes away: its place is freed
            assert [s for s, _ in await asyncio.wait_for(asyncio.gather(b_waiting, a_waiting), 30)] == [200, 200]
            assert [said(r) for r in lm.requests] == ["a1", "b1", "a2"]  # b first: it had none in flight
            # Each tenant's prompts in its own prefix-cache namespace (vLLM's cache_salt).
            assert [json.loads(r.openai.body)["cache_salt"] for r in lm.requests] == ["a:", "b:", "a:"]

    run(body)


def test_a_tenant_whose_grpc_messages_never_come_holds_only_its_share_of_the_readers(tmp_path):
    """Tenant a opens calls whose request message never comes: past its share of the gRPC readers it is
    refused after a wait of WAIT_S for one of its own (RESOURCE_EXHAUSTED), and tenant b's call is still read and served."""
    from services.gateway.intake import GRPC_READERS_PER_TENANT

    keys = write_keys(tmp_path / "keys.jsonl", ("a", KEY_A), ("b", KEY_B))

    async def body():
        async with keyed_gateway(api_keys_file=keys, body_timeout_s=20.0) as (gw, lm):
            method = "/epd.gateway.v1.GatewayService/ChatCompletion"
            auth_a = (("authorization", f"Bearer {KEY_A}"),)
            stalled = [gw.channel.stream_stream(method)(metadata=auth_a) for _ in range(GRPC_READERS_PER_TENANT)]
            await gw.poll(lambda: metric(gw, "epd_gateway_bodies_reading"), lambda v: v >= GRPC_READERS_PER_TENANT,
                          20, "a's stalled calls hold their readers")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                one_more = gw.channel.stream_stream(method)(metadata=auth_a)
                await one_more.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant a" in e.value.details()
            async with gw.connection() as b_channel:  # b, another client: its own connection
                assert await grpc_chat(gw, KEY_B, channel=b_channel) == grpc.StatusCode.OK  # b still has room
            for call in stalled:
                call.cancel()

    run(body)
