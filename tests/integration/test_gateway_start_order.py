"""The whole gateway (``server.serve``: REST, native gRPC, instance pools) in
process against fake LM and encoder gRPC servers that start after it, in any
order: 503 with the reason until an LM is admitted, then normal service; a
peer that refuses the gateway's credentials is never admitted. Also the REST
checks that must answer before a stream starts, and request ids. No vLLM;
every wait is a poll with a bounded deadline.

Ports: a server that starts before it is dialled binds port 0 and reports the
port it got (the fakes' ``GrpcServer.start()``, the gateway's ``on_listening``).
A peer that starts *after* the gateway, at an address the gateway was given
up front, and the gateway's gRPC API (its port 0 means "disabled") get a port
from ``services.up.free_port``. That leaves a gap between choosing and binding,
but the port lies below the kernel's ephemeral range, so nothing that binds
port 0 or dials out meanwhile (the gateway's own channels, other tests' servers)
can take it, and one process never hands it out twice."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from peerauth import SecurityConfig
from services.certs import make_token
from services.common.protocol import ENCODER_PROTOCOL
from services.up import free_port
from tests.integration.gateway_fakes import FakeEncoder, FakeLM, World, serve_fake
from tests.integration.gateway_harness import Gateway
from tools.media import data_url, make_image

pytestmark = pytest.mark.integration

TEST_LIMIT_S = 60.0  # a hang guard: each test takes a few seconds
NOT_READY = "no LM is ready yet"


def run(body) -> None:
    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def chat(text: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


def image_chat(seed: int = 0) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (16, 16)))}},
        {"type": "text", "text": "what is it?"}]}]}


def tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def chunks_of(messages: list[gateway_pb2.OpenAIResponse]) -> list[dict]:
    """The JSON chunks of a gRPC stream (the last message carries only ``epd``)."""
    return [json.loads(m.body) for m in messages if m.body]


# --- start in any order -----------------------------------------------------------------------------------------



@contextlib.asynccontextmanager
async def admitted_gateway():
    """A gateway (``Gateway``) whose one fake LM is admitted: yields (gateway, lm)."""
    lm = FakeLM("lm-X", World())
    server, addr = await serve_fake(lm)
    try:
        async with Gateway(lms=addr) as gw:
            await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the LM is admitted")
            yield gw, lm
    finally:
        await server.stop(0)

def test_a_gateway_started_before_its_lm_answers_503_with_the_reason_then_serves_once_the_lm_is_up():
    async def body():
        world, lm_port = World(), free_port()
        async with Gateway(lms=f"127.0.0.1:{lm_port}") as gw:
            status, health = await gw.get("/health")
            assert status == 503 and health["status"].startswith(NOT_READY) and health["model"] is None
            assert f"127.0.0.1:{lm_port}" in health["status"]  # says what it waits for
            status, err, _ = await gw.post("/v1/chat/completions", chat())
            assert status == 503 and err["error"]["type"] == "server_error"
            assert err["error"]["message"].startswith(NOT_READY)
            status, err, _ = await gw.post("/v1/chat/completions", chat(stream=True))
            assert status == 503 and err["error"]["message"].startswith(NOT_READY)  # a plain error, no stream
            status, err, _ = await gw.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and err["error"]["message"].startswith(NOT_READY)
            status, err = await gw.get("/v1/models")
            assert status == 503 and err["error"]["message"].startswith(NOT_READY)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gw.grpc_chat()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details().startswith(NOT_READY)

            lm = FakeLM("lm-X", world)
            server, _ = await serve_fake(lm, lm_port)
            try:
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the LM is admitted")
                status, out, _ = await gw.post("/v1/chat/completions", chat())
                assert status == 200 and tokens(out) == [1, 2, 3] and out["model"] == "fake-model"
                status, models = await gw.get("/v1/models")
                assert status == 200 and [m["id"] for m in models["data"]] == ["fake-model"]
                messages = await gw.grpc_chat()
                chunks = chunks_of(messages)
                assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [1, 2, 3]
                assert {c["model"] for c in chunks} == {"fake-model"}
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
                assert not messages[-1].body and json.loads(messages[-1].epd)["lm"] == f"127.0.0.1:{lm_port}"
                assert len(lm.requests) == 2
            finally:
                await server.stop(0)

    run(body)


def test_an_encoder_that_starts_after_the_gateway_is_admitted_and_used():
    async def body():
        world, enc_port = World(), free_port()
        lm = FakeLM("lm-X", world)
        lm_server, lm_addr = await serve_fake(lm)
        enc_server = None
        try:
            async with Gateway(lms=lm_addr, encoders=f"127.0.0.1:{enc_port}") as gw:
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the LM is admitted")
                status, out, _ = await gw.post("/v1/chat/completions", image_chat(0))
                assert status == 200 and out["epd"]["encoders"] == []  # no encoder yet: the LM encoded itself
                enc = FakeEncoder("enc-A", world, wait_lm_s=0.5)
                enc_server, _ = await serve_fake(enc, enc_port)
                await gw.poll(lambda: gw.get("/health"), lambda r: r[1]["encoders"][f"127.0.0.1:{enc_port}"],
                              10, "the encoder is admitted")
                status, out, _ = await gw.post("/v1/chat/completions", image_chat(1))
                assert status == 200 and out["epd"]["encoders"] == [f"127.0.0.1:{enc_port}"]
                assert len(enc.requests) == 1 and lm.requests[-1].items[0].source.encoder_id == "enc-A"
        finally:
            await lm_server.stop(0)
            if enc_server is not None:
                await enc_server.stop(0)

    run(body)


def test_an_encoder_holding_another_auth_token_is_refused_with_the_reason_and_items_go_to_the_good_one(tmp_path):
    async def body():
        world = World()
        lm, bad, good = FakeLM("lm-X", world), FakeEncoder("enc-bad", world, 0.5), FakeEncoder("enc-good", world, 0.5)
        # Health checks take no token, so only the admission's GetInfo can tell the bad encoder apart.
        servers = [await serve_fake(lm), await serve_fake(good),
                   await serve_fake(bad, security=SecurityConfig(auth_token_file=make_token(str(tmp_path / "enc"))))]
        (_, lm_addr), (_, good_addr), (_, bad_addr) = servers
        try:
            async with Gateway(SecurityConfig(auth_token_file=make_token(str(tmp_path / "gateway"))), lms=lm_addr,
                               encoders=f"{bad_addr},{good_addr}") as gw:
                status, health = await gw.poll(lambda: gw.get("/health"),
                                               lambda r: r[0] == 200 and r[1]["encoders"][good_addr], 10,
                                               "the good encoder is admitted")
                assert health["encoders"] == {bad_addr: False, good_addr: True}
                assert health["out"]["encoders"][bad_addr].startswith(
                    "refused: GetInfo failed: UNAUTHENTICATED (it refuses this gateway's credentials")
                for seed in range(4):  # four images: were both admitted, hashing would spread them
                    status, out, _ = await gw.post("/v1/chat/completions", image_chat(seed))
                    assert status == 200 and out["epd"]["encoders"] == [good_addr], out
                assert bad.requests == [] and len(good.requests) == 4
                _, health = await gw.get("/health")  # re-verified on every round, refused every time
                assert health["out"]["encoders"][bad_addr].startswith("refused: GetInfo failed: UNAUTHENTICATED")
        finally:
            for server, _ in servers:
                await server.stop(0)

    run(body)


def test_an_encoder_of_another_protocol_is_refused_with_the_versions_and_never_sent_work():
    """An encoder from before ItemMetadata carried an ItemSource reports protocol 0 (the field did not
    exist): its metadata would be misread, so it is never admitted, and /health says why."""
    async def body():
        world = World()
        lm, old, good = FakeLM("lm-X", world), FakeEncoder("enc-old", world, 0.5), FakeEncoder("enc-good", world, 0.5)
        old.protocol = 0
        servers = [await serve_fake(lm), await serve_fake(old), await serve_fake(good)]
        (_, lm_addr), (_, old_addr), (_, good_addr) = servers
        try:
            async with Gateway(lms=lm_addr, encoders=f"{old_addr},{good_addr}") as gw:
                _, health = await gw.poll(lambda: gw.get("/health"),
                                          lambda r: r[0] == 200 and r[1]["encoders"][good_addr], 10,
                                          "the good encoder is admitted")
                assert health["encoders"] == {old_addr: False, good_addr: True}
                assert health["out"]["encoders"][old_addr] == (
                    f"refused: speaks encoder protocol 0, this gateway protocol {ENCODER_PROTOCOL} "
                    "(an older epd-serve; run one version across the deployment)")
                for seed in range(4):
                    status, out, _ = await gw.post("/v1/chat/completions", image_chat(seed))
                    assert status == 200 and out["epd"]["encoders"] == [good_addr], out
                assert old.requests == []
        finally:
            for server, _ in servers:
                await server.stop(0)

    run(body)


def test_with_model_name_set_an_lm_serving_another_model_is_refused_and_one_that_agrees_is_admitted():
    async def body():
        world = World()
        wrong = FakeLM("lm-wrong", world, model="/models/other-model")
        right = FakeLM("lm-right", world, model="/models/tiny")
        wrong_server, wrong_addr = await serve_fake(wrong)
        right_port = free_port()
        right_server = None
        try:
            async with Gateway(lms=f"{wrong_addr},127.0.0.1:{right_port}", model_name="tiny") as gw:
                status, models = await gw.get("/v1/models")  # configured: known before any LM
                assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
                status, health = await gw.poll(
                    lambda: gw.get("/health"), lambda r: "serves model" in r[1]["status"], 10, "the LM is refused")
                assert status == 503 and "serves model '/models/other-model', not 'tiny'" in health["status"]
                status, err, _ = await gw.post("/v1/chat/completions", chat())
                assert status == 503 and "serves model '/models/other-model'" in err["error"]["message"]
                right_server, _ = await serve_fake(right, right_port)  # a path ending in the name agrees
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the agreeing LM is admitted")
                for _ in range(3):
                    status, out, _ = await gw.post("/v1/chat/completions", chat(model="tiny"))
                    assert status == 200 and out["model"] == "tiny"
                assert wrong.requests == [] and len(right.requests) == 3
                _, health = await gw.get("/health")
                assert health["lms"] == {wrong_addr: False, f"127.0.0.1:{right_port}": True}
        finally:
            await wrong_server.stop(0)
            if right_server is not None:
                await right_server.stop(0)

    run(body)


def test_an_lm_serving_another_model_than_the_first_admitted_is_never_routed_to():
    async def body():
        world = World()
        first, other = FakeLM("lm-first", world), FakeLM("lm-other", world, model="other-model")
        first_server, first_addr = await serve_fake(first)
        other_port = free_port()
        other_server = None
        try:
            async with Gateway(lms=f"{first_addr},127.0.0.1:{other_port}") as gw:
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 10, "the first LM is admitted")
                other_server, other_addr = await serve_fake(other, other_port)
                _, health = await gw.poll(lambda: gw.get("/health"), lambda r: r[1]["out"]["lms"].get(other_addr, "")
                                          .startswith("refused"), 10, "the other LM is refused")
                assert health["out"]["lms"][other_addr] == ("refused: serves model 'other-model', not 'fake-model' "
                                                            "(the model of the first LM admitted)")
                assert health["lms"] == {first_addr: True, other_addr: False} and health["model"] == "fake-model"
                for _ in range(4):
                    status, out, _ = await gw.post("/v1/chat/completions", chat())
                    assert status == 200 and out["model"] == "fake-model"
                assert other.requests == [] and len(first.requests) == 4
        finally:
            await first_server.stop(0)
            if other_server is not None:
                await other_server.stop(0)

    run(body)


# --- input checked before anything starts, and request ids -------------------------------------------------------


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', None),
], ids=["nan", "infinity"])
def test_json_that_is_not_json_is_400_at_the_gateway_before_any_lm_call(raw, param):
    """NaN and Infinity are no JSON numbers: the gateway refuses the body itself."""
    async def body():
        async with admitted_gateway() as (gw, lm):
            status, err, headers = await gw.post("/v1/chat/completions", raw,
                                                 {"Content-Type": "application/json"})
            assert status == 400 and headers["Content-Type"].startswith("application/json"), (status, err)
            assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
            assert lm.requests == []

    run(body)


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e39}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 1.9}', "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": "yes"}',
     "stream_options"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": [true]}',
     "stream_options"),
], ids=["float32-overflow", "n-not-integer", "stream-options-string", "stream-options-list"])
def test_bad_sampling_and_stream_options_are_400_before_any_stream_starts(raw, param):
    """Sampling and stream options are vLLM's to validate (on the LM): its 400 answer comes back as a
    plain JSON error with vLLM's body, never as a started stream, even for "stream": true."""
    async def body():
        async with admitted_gateway() as (gw, lm):
            lm.world.lm_script = [f"bad_request:{param}"]
            status, err, headers = await gw.post("/v1/chat/completions", raw,
                                                 {"Content-Type": "application/json"})
            assert status == 400 and headers["Content-Type"].startswith("application/json"), (status, err)
            assert err == {"error": {"message": f"{param}: bad value", "type": "BadRequestError", "param": param,
                                     "code": 400}}
            (sent,) = lm.requests
            sent_body = json.loads(sent.openai.body)
            assert sent.openai.api == "chat" and sent_body.pop("request_id")
            assert sent_body == json.loads(raw)  # passed on as the client sent it (and its id added)

    run(body)


def test_two_requests_with_one_x_request_id_reach_the_lm_under_distinct_ids_and_the_client_sees_its_own():
    async def body():
        async with admitted_gateway() as (gw, lm):
            hdr = {"X-Request-Id": "same-id"}
            (s1, b1, h1), (s2, b2, h2) = await asyncio.gather(
                gw.post("/v1/chat/completions", chat(), hdr), gw.post("/v1/completions", {"prompt": "x"}, hdr))
            assert (s1, s2) == (200, 200)
            # The bodies are vLLM's, named from the client's id as `vllm serve` names them from X-Request-Id.
            assert h1["X-Request-Id"] == h2["X-Request-Id"] == "same-id"
            assert (b1["id"], b2["id"]) == ("chatcmpl-same-id", "cmpl-same-id")
            sent = [r.request_id for r in lm.requests]
            assert len(set(sent)) == 2 and all(r.startswith("same-id-") for r in sent), sent
            status, out, headers = await gw.post("/v1/chat/completions", chat(stream=True), hdr)
            assert status == 200 and headers["X-Request-Id"] == "same-id"
            events = [json.loads(line[6:]) for line in out["sse"].splitlines()
                      if line.startswith("data: {")]
            assert events and {e["id"] for e in events} == {"chatcmpl-same-id"}
            assert len({r.request_id for r in lm.requests}) == 3

    run(body)


def test_the_grpc_api_refuses_a_nan_temperature():
    async def body():
        async with admitted_gateway() as (gw, lm):
            stub = gateway_pb2_grpc.GatewayServiceStub(gw.channel)
            req = gateway_pb2.OpenAIRequest(
                body=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.ChatCompletion(req, timeout=10):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in e.value.details()
            assert lm.requests == []

    run(body)



def test_two_grpc_calls_with_one_request_id_reach_the_lm_under_distinct_ids_and_chunks_carry_them():
    async def body():
        async with admitted_gateway() as (gw, lm):
            for _ in range(2):
                chunks = chunks_of(await gw.grpc_chat(request_id="g-id"))
                assert chunks and {c["id"] for c in chunks} == {"chatcmpl-g-id"}  # vLLM's, from the client's id
            sent = [r.request_id for r in lm.requests]
            assert len(set(sent)) == 2 and all(r.startswith("g-id-") for r in sent), sent

    run(body)


def test_without_epd_facts_answers_say_nothing_of_the_deployment(tmp_path):
    """The default gateway: no ``epd`` object, /health says only whether it serves, and a
    deployment fault (no LM reachable) names the request, not the instances."""

    async def main():
        lm_port = free_port()
        async with Gateway(lms=f"127.0.0.1:{lm_port}", epd_facts=False) as gw:
            status, health = await gw.get("/health")
            assert status == 503 and health == {"status": "unavailable", "model": None}
            assert str(lm_port) not in json.dumps(health)

    asyncio.run(main())
