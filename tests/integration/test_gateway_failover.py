"""The gateway's Orchestrator against fake encoder and LM gRPC servers
(in-process grpc.aio on loopback): dispatch order, routing of items, and
failover before the first token. No vLLM; each test runs in a few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from epd.encoder.v1 import encoder_pb2
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig
from services.certs import make_token
from services.common.grpc_server import GrpcServer
from services.gateway import routing
from services.gateway.config import GatewayConfig
from services.gateway.instances import InstancePool
from services.gateway.lm_body import LMBody
from services.gateway.orchestrator import Orchestrator
from services.gateway.request import MEDIA_REF, parse_openai
from services.gateway.values import Media, Timings
from tests.integration.gateway_fakes import FakeEncoder, FakeLM, World, serve_fake, wait_until
from tools.media import data_url

pytestmark = pytest.mark.integration
TEST_LIMIT_S = 60.0  # a hang guard: each test takes a few seconds


class Cluster:
    """Two fake encoders and two fake LMs, each on its own GrpcServer. ``security``: fake name -> what its
    server requires (TLS, token); the others check nothing."""

    def __init__(self, n_encoders: int = 2, n_lms: int = 2, wait_lm_s: float = 2.0,
                 security: dict[str, SecurityConfig] | None = None) -> None:
        self.world = World()
        self.security = security or {}
        self.encoders = [FakeEncoder(f"enc-{c}", self.world, wait_lm_s) for c in "AB"[:n_encoders]]
        self.lms = [FakeLM(f"lm-{c}", self.world) for c in "XY"[:n_lms]]
        self.servers: dict[str, GrpcServer] = {}  # address -> server
        self.by_address: dict[str, FakeEncoder | FakeLM] = {}
        self.orch: Orchestrator | None = None

    async def serve(self, fake, port: int = 0) -> str:
        server, address = await serve_fake(fake, port, self.security.get(fake.name))
        self.servers[address] = server
        self.by_address[address] = fake
        return address

    async def start(self, gateway_security: SecurityConfig | None = None, **cfg) -> Orchestrator:
        self.enc_addresses = [await self.serve(e) for e in self.encoders]
        self.lm_addresses = [await self.serve(lm) for lm in self.lms]
        # encode_timeout_s: past the time a healthy fake encode takes even on a slow, busy host (a 1 s
        # limit there failed good encodes and retried them); the tests of the timeout set a short one.
        defaults = dict(encoders=",".join(self.enc_addresses), lms=",".join(self.lm_addresses),
                        health_interval_s=0.2, encode_timeout_s=10.0, request_timeout_s=20.0)
        self.orch = Orchestrator(GatewayConfig(**{**defaults, **cfg}), gateway_security)
        await self.orch.start()
        return self.orch

    async def stop_server(self, address: str) -> None:
        await self.servers.pop(address).stop(grace=0)

    async def close(self) -> None:
        if self.orch is not None:
            await self.orch.close()
        await asyncio.gather(*(s.stop(grace=0) for s in self.servers.values()), return_exceptions=True)

    def encoder_for(self, identifier: str) -> FakeEncoder:
        """The fake encoder that rendezvous routing picks for ``identifier`` (all healthy, idle)."""
        inst = routing.pick_encoder(identifier, list(self.orch.encoders.instances.values()), 1 << 30)
        return self.by_address[inst.address]

    def encode_calls(self) -> int:
        return sum(len(e.requests) for e in self.encoders)

    def lm_requests(self) -> list[lm_pb2.GenerateRequest]:
        """Every Generate request, in arrival order."""
        order = [(who, rid) for who, what, rid in self.world.log if what == "generate"]
        seen: dict[str, int] = {}
        out = []
        for who, _ in order:
            lm = next(lm for lm in self.lms if lm.name == who)
            out.append(lm.requests[seen.get(who, 0)])
            seen[who] = seen.get(who, 0) + 1
        return out


def run_cluster(body: Callable[[Cluster], Awaitable[None]], **cluster_kw) -> None:
    async def main():
        cluster = Cluster(**cluster_kw)
        try:
            await asyncio.wait_for(body(cluster), TEST_LIMIT_S)
        finally:
            await cluster.close()

    asyncio.run(main())


def request(rid: str, identifiers: list[str], stream: bool = False) -> tuple[lm_pb2.GenerateRequest, list[Media]]:
    """A chat request with one image (bytes ``b"x"``) per identifier, as the gateway's APIs hand it to the
    orchestrator: the client's OpenAI body in ``openai.body`` (images as gRPC ``epd-media:N`` parts; each
    LM attempt gets its own body from ``lm_body``) and one item per image."""
    content = [{"type": "image_url", "image_url": {"url": f"{MEDIA_REF}{n}"}} for n in range(len(identifiers))]
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "describe"}]}],
            "max_tokens": 3, "stream": stream}
    req = lm_pb2.GenerateRequest(request_id=rid, items=[lm_pb2.MMItem(modality="image", identifier=i)
                                                        for i in identifiers])
    req.openai.api = "chat"
    req.openai.body = json.dumps(body).encode()
    return req, [Media(data=b"x", identifier=i) for i in identifiers]


def lm_body(orch: Orchestrator, req: lm_pb2.GenerateRequest, media: list[Media]) -> LMBody:
    """What the gateway's APIs pass as ``generate(body=...)``: each LM attempt's body from the client's."""
    return parse_openai(req.openai.api, req.openai.body, orch.cfg, [m.data for m in media]).for_lm(media)


def generate(orch: Orchestrator, req, media, timings: Timings):
    return orch.generate(req, media, timings, body=lm_body(orch, req, media))


async def collect(orch: Orchestrator, req, media, timings: Timings | None = None) -> list[lm_pb2.GenerateResponse]:
    timings = timings if timings is not None else Timings()
    return [r async for r in generate(orch, req, media, timings)]


def tokens(responses: list[lm_pb2.GenerateResponse]) -> list[int]:
    """The first choice's token ids in the LM's OpenAI answers (vLLM's "token_ids"): a whole body, or
    the chunks of its server-sent events."""
    out = []
    for r in responses:
        if r.openai.startswith(b"data: "):
            bodies = [json.loads(line[6:]) for line in r.openai.split(b"\n")
                      if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]"]
        else:
            bodies = [json.loads(r.openai)] if r.openai else []
        out += [t for b in bodies for c in b["choices"][:1] for t in c.get("token_ids") or []]
    return out


def image_parts(req: lm_pb2.GenerateRequest) -> list[dict]:
    """The image parts of the OpenAI body an LM received, in order."""
    body = json.loads(req.openai.body)
    return [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
            if p["type"] == "image_url"]


def retries(role: str, code: str) -> float:
    return REGISTRY.get_sample_value("epd_gateway_retries_total", {"role": role, "code": code}) or 0.0


def ejections(role: str, address: str) -> float:
    return REGISTRY.get_sample_value("epd_gateway_instance_ejections_total",
                                     {"role": role, "instance": address}) or 0.0


def fallbacks() -> float:
    return REGISTRY.get_sample_value("epd_gateway_local_encode_fallback_total") or 0.0


async def assert_idle(orch: Orchestrator) -> None:
    """Every call the orchestrator made is accounted as finished (cancelled
    encode tasks unwind a loop step after the request ends)."""
    def busy():
        return {i.address: i.outstanding for p in (orch.encoders, orch.lms) for i in p.instances.values()
                if i.outstanding}

    with contextlib.suppress(AssertionError):
        await wait_until(lambda: not busy(), 1, "idle")
    assert busy() == {}


def ids(n: int, prefix: str = "") -> list[str]:
    """``n`` content hashes (hex sha256), distinct per ``prefix``."""
    return [hashlib.sha256(f"{prefix}{i}".encode()).hexdigest() for i in range(n)]


# --- happy path and dispatch order --------------------------------------------------------------------------------


def test_overlap_starts_the_lm_before_the_encoder_has_encoded():
    async def body(c: Cluster):
        orch = await c.start(dispatch="overlap")
        ident = ids(1)[0]
        req, media = request("r-overlap", [ident])
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3] and out[-1].finish_reason == "stop"
        enc = c.encoder_for(ident)
        want = encoder_pb2.MediaItem(modality="image", data=b"x", identifier=ident)
        assert [list(r.items) for r in enc.requests] == [[want]]
        (lm_req,) = c.lm_requests()
        src = lm_req.items[0].source
        assert (src.transfer_endpoint, src.encoder_id) == (enc.endpoint, enc.name)
        assert (src.num_embeds, src.embed_width, src.dtype) == (16, 64, transfer_pb2.BFLOAT16)
        w = c.world
        assert w.at("metadata", "r-overlap") < w.at("generate", "r-overlap") < w.at("encoded", "r-overlap")
        assert timings.encoders == [next(a for a, f in c.by_address.items() if f is enc)]
        assert timings.lm in c.lm_addresses and timings.retries == 0 and timings.encode_ms == 5.0
        await assert_idle(orch)

    run_cluster(body)


def test_sequential_starts_the_lm_only_after_every_item_is_encoded():
    async def body(c: Cluster):
        orch = await c.start(dispatch="sequential")
        ident = ids(1)[0]
        req, media = request("r-seq", [ident])
        out = await collect(orch, req, media)
        assert tokens(out) == [1, 2, 3]
        enc = c.encoder_for(ident)
        (lm_req,) = c.lm_requests()
        assert lm_req.items[0].source.transfer_endpoint == enc.endpoint
        assert c.world.at("encoded", "r-seq") < c.world.at("generate", "r-seq")

    run_cluster(body, wait_lm_s=0.3)  # the encoder waits a little for an LM call that must not come yet


def test_a_text_only_request_goes_straight_to_an_lm():
    async def body(c: Cluster):
        orch = await c.start()
        out = await collect(orch, *request("r-text", []))
        assert tokens(out) == [1, 2, 3]
        assert c.encode_calls() == 0 and len(c.lm_requests()) == 1
        (lm_req,) = c.lm_requests()
        assert list(lm_req.items) == [] and image_parts(lm_req) == []

    run_cluster(body)


def test_items_with_different_hashes_go_to_their_own_encoders():
    async def body(c: Cluster):
        orch = await c.start()
        candidates = ids(64)
        first = candidates[0]
        second = next(i for i in candidates if c.encoder_for(i) is not c.encoder_for(first))
        req, media = request("r-two", [first, second])
        out = await collect(orch, req, media)
        assert tokens(out) == [1, 2, 3]
        for ident in (first, second):
            enc = c.encoder_for(ident)
            assert [[it.identifier for it in r.items] for r in enc.requests] == [[ident]]
        (lm_req,) = c.lm_requests()
        assert [it.identifier for it in lm_req.items] == [first, second]
        assert [it.source.transfer_endpoint for it in lm_req.items] == [c.encoder_for(first).endpoint,
                                                                         c.encoder_for(second).endpoint]

    run_cluster(body)


def test_items_of_two_modalities_on_one_encoder_go_in_one_encode_call_each():
    """An Encode call carries one modality (the encoder builds one prompt of that modality's
    placeholders); items keep their request order in the LM's request."""
    async def body(c: Cluster):
        orch = await c.start()
        ident = ids(1, "m")[0]
        other = next(i for i in ids(64, "n") if c.encoder_for(i) is c.encoder_for(ident))
        req, media = request("r-mixed", [ident, other, ident])
        req.items[1].modality = media[1].modality = "audio"
        await collect(orch, req, media)
        enc = c.encoder_for(ident)
        assert sorted([(it.modality, it.identifier) for it in r.items] for r in enc.requests) == [
            [("audio", other)], [("image", ident), ("image", ident)]]
        (lm_req,) = c.lm_requests()
        assert [(it.modality, it.identifier) for it in lm_req.items] == [("image", ident), ("audio", other),
                                                                          ("image", ident)]
        assert all(it.source.transfer_endpoint == enc.endpoint for it in lm_req.items)

    run_cluster(body)


def test_repeated_items_stick_to_one_encoder():
    async def body(c: Cluster):
        orch = await c.start()
        ident = ids(1, "f")[0]
        for n in range(4):
            req, media = request(f"r-rep{n}", [ident])
            await collect(orch, req, media)
        assert len(c.encoder_for(ident).requests) == 4 and c.encode_calls() == 4

    run_cluster(body)


# --- encoder failures ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["unavailable", "abort_unavailable"])
def test_an_encoder_failing_before_metadata_is_replaced_by_the_other(mode):
    async def body(c: Cluster):
        orch = await c.start()
        c.world.enc_script = [mode]
        ident = ids(1, "1")[0]
        before = retries("encoder", "UNAVAILABLE")
        req, media = request("r-encfail", [ident])
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3]
        failed = c.encoder_for(ident)
        other = next(e for e in c.encoders if e is not failed)
        assert len(failed.requests) == 1 and len(other.requests) == 1
        (lm_req,) = c.lm_requests()  # the LM only ever saw the good attempt
        assert lm_req.items[0].source.transfer_endpoint == other.endpoint
        assert timings.retries == 1
        assert retries("encoder", "UNAVAILABLE") - before == 1
        assert orch.health()["encoders"] == dict.fromkeys(c.enc_addresses, True)  # still serving: not ejected

    run_cluster(body)


def test_a_hanging_encoder_is_replaced_after_encode_timeout():
    async def body(c: Cluster):
        orch = await c.start(encode_timeout_s=2.0)
        c.world.enc_script = ["hang"]
        ident = ids(1, "2")[0]
        before = retries("encoder", "DEADLINE_EXCEEDED")
        req, media = request("r-hang", [ident])
        timings = Timings()
        t0 = time.monotonic()
        out = await collect(orch, req, media, timings)
        elapsed = time.monotonic() - t0
        assert tokens(out) == [1, 2, 3]
        assert 2.0 <= elapsed < 15.0  # the encode timeout fired (2 s), and nothing hung (the request's is 20 s)
        hung = c.encoder_for(ident)
        other = next(e for e in c.encoders if e is not hung)
        (lm_req,) = c.lm_requests()
        assert lm_req.items[0].source.transfer_endpoint == other.endpoint
        assert timings.retries == 1 and retries("encoder", "DEADLINE_EXCEEDED") - before == 1
        await assert_idle(orch)

    run_cluster(body)


def test_an_encoder_failing_after_metadata_cancels_the_waiting_lm_and_the_retry_succeeds():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.enc_script = ["fail_after_metadata"]
        c.world.lm_script = ["block"]
        ident = ids(1, "3")[0]
        req, media = request("r-mid", [ident])
        timings = Timings()
        t0 = time.monotonic()
        out = await collect(orch, req, media, timings)
        assert time.monotonic() - t0 < 15  # not the LM's 30 s block (nor the request's 20 s timeout)
        assert tokens(out) == [1, 2, 3]
        first, second = c.lm_requests()
        failed = c.encoder_for(ident)
        other = next(e for e in c.encoders if e is not failed)
        assert first.items[0].source.transfer_endpoint == failed.endpoint
        assert second.items[0].source.transfer_endpoint == other.endpoint
        await wait_until(lambda: sum(len(lm.cancelled) for lm in c.lms) == 1, 2, "the blocked LM call is cancelled")
        assert [rid for lm in c.lms for rid in lm.cancelled] == ["r-mid"]
        assert timings.retries == 1
        await assert_idle(orch)

    run_cluster(body)


def test_the_lm_gets_no_image_bytes_with_a_layout_and_a_retry_without_one_gets_them_back():
    async def body(c: Cluster):
        orch = await c.start()
        ident = ids(1, "5")[0]
        affine = c.encoder_for(ident)
        affine.layout = True  # the other encoder sends none (an older version, say)
        c.world.lm_script = ["encoder_unavailable"]
        req, media = request("r-layout", [ident])
        assert tokens(await collect(orch, req, media)) == [1, 2, 3]
        first, second = c.lm_requests()
        assert list(first.items[0].source.placeholder_token_ids) == [9]
        assert list(first.items[0].source.prompt_token_ids) == [5] * 16
        # Laid out by the encoder: a uuid-only part, no bytes.
        assert image_parts(first) == [{"type": "image_url", "image_url": None, "uuid": ident}]
        # No layout: the LM processes the image, so it gets the bytes (named by the content hash).
        assert not second.items[0].source.placeholder_token_ids and second.items[0].HasField("source")
        assert image_parts(second) == [{"type": "image_url", "image_url": {"url": data_url(b"x")}, "uuid": ident}]

    run_cluster(body)


def test_an_encode_still_ending_when_the_lm_answered_is_left_to_end_not_aborted():
    async def body(c: Cluster):
        orch = await c.start()
        for e in c.encoders:
            e.mode = "late_encoded"
        req, media = request("r-late", ids(1, "6"))
        assert tokens(await collect(orch, req, media)) == [1, 2, 3]
        assert ("enc-A", "encoded", "r-late") not in c.world.log and ("enc-B", "encoded", "r-late") not in c.world.log
        await wait_until(lambda: any(what == "encoded" for _, what, _ in c.world.log), 2, "the encode ended")
        assert [rid for e in c.encoders for rid in e.cancelled] == []

    run_cluster(body)


def test_an_lm_reporting_its_encoder_unavailable_re_encodes_on_the_other_encoder():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["encoder_unavailable"]
        ident = ids(1, "4")[0]
        before_enc, before_lm = retries("encoder", "UNAVAILABLE"), retries("lm", "UNAVAILABLE")
        req, media = request("r-pull", [ident])
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3]
        first, second = c.lm_requests()
        affine = c.encoder_for(ident)
        other = next(e for e in c.encoders if e is not affine)
        assert first.items[0].source.transfer_endpoint == affine.endpoint
        assert second.items[0].source.transfer_endpoint == other.endpoint
        assert len(affine.requests) == 1 and len(other.requests) == 1
        assert retries("encoder", "UNAVAILABLE") - before_enc == 1  # blamed on the encoder ...
        assert retries("lm", "UNAVAILABLE") == before_lm  # ... not the LM
        assert timings.retries == 1

    run_cluster(body)


# --- LM failures --------------------------------------------------------------------------------------------------


def test_an_lm_unavailable_before_the_first_token_is_retried_on_the_other_lm():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["unavailable"]
        before = retries("lm", "UNAVAILABLE")
        req, media = request("r-lm", ids(1, "5"))
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3]
        calls = [who for who, what, _ in c.world.log if what == "generate"]
        assert len(calls) == 2 and calls[0] != calls[1]
        lm_names = {lm.name: a for a, lm in c.by_address.items() if isinstance(lm, FakeLM)}
        assert timings.lm == lm_names[calls[1]]
        assert timings.retries == 1 and retries("lm", "UNAVAILABLE") - before == 1

    run_cluster(body)


def test_the_retry_carries_a_fresh_request_id_and_the_caller_keeps_its_own():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["unavailable"]
        req, media = request("base-id", ids(1, "6"))
        await collect(orch, req, media)
        assert [r.request_id for r in c.lm_requests()] == ["base-id", "base-id-retry1"]
        assert [r.request_id for e in c.encoders for r in e.requests] == ["base-id", "base-id-retry1"]
        assert req.request_id == "base-id"

    run_cluster(body)


def test_the_caller_keeps_its_request_id_when_every_attempt_fails():
    async def body(c: Cluster):
        orch = await c.start(max_attempts=3)
        c.world.lm_script = ["unavailable"] * 3
        req, media = request("base-id", [])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, req, media)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # Each LM is tried once; with both excluded the third attempt finds no LM.
        assert [r.request_id for r in c.lm_requests()] == ["base-id", "base-id-retry1"]
        assert sorted(len(lm.requests) for lm in c.lms) == [1, 1]
        assert "no healthy LM" in e.value.details()
        assert req.request_id == "base-id"

    run_cluster(body)


def test_an_lm_failing_after_the_first_token_ends_the_stream_without_retry():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["fail_after_first"]
        req, media = request("r-late", ids(1, "7"), stream=True)
        timings = Timings()
        seen: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for resp in generate(orch, req, media, timings):
                seen.extend(tokens([resp]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert seen == [1, 2]
        assert len(c.lm_requests()) == 1 and c.encode_calls() == 1 and timings.retries == 0
        await assert_idle(orch)

    run_cluster(body)


# --- credentials: refused at admission, refusals retried elsewhere -------------------------------------------------


def tokens_for(tmp_path, *names: str) -> dict[str, SecurityConfig]:
    """A server-side ``SecurityConfig`` per fake name, each with its own random token."""
    return {n: SecurityConfig(auth_token_file=make_token(str(tmp_path / n))) for n in names}


def test_an_encoder_that_refuses_the_gateways_token_is_never_admitted_and_every_item_goes_to_the_other(tmp_path):
    gateway = SecurityConfig(auth_token_file=make_token(str(tmp_path / "gateway")))

    async def body(c: Cluster):
        orch = await c.start(gateway)
        bad_addr, good_addr = c.enc_addresses  # enc-A holds another token; its health check still passes
        assert orch.health()["encoders"] == {bad_addr: False, good_addr: True}
        assert orch.not_admitted()["encoders"][bad_addr].startswith(
            "refused: GetInfo failed: UNAUTHENTICATED (it refuses this gateway's credentials")
        before = retries("encoder", "UNAUTHENTICATED")
        timings = Timings()
        out = await collect(orch, *request("r-token", ids(6, "t")), timings)
        assert tokens(out) == [1, 2, 3] and timings.encoders == [good_addr] and timings.retries == 0
        assert c.encoders[0].requests == [] and len(c.encoders[1].requests) == 1
        await asyncio.sleep(0.5)  # more health rounds (every 0.2 s): verified again, refused again
        assert orch.health()["encoders"][bad_addr] is False
        assert retries("encoder", "UNAUTHENTICATED") == before

    run_cluster(body, security=tokens_for(tmp_path, "enc-A"))


def test_with_only_an_encoder_that_refuses_the_token_and_no_local_fallback_the_error_says_why(tmp_path):
    gateway = SecurityConfig(auth_token_file=make_token(str(tmp_path / "gateway")))

    async def body(c: Cluster):
        orch = await c.start(gateway, local_encode_fallback=False)
        (addr,) = c.enc_addresses
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, *request("r-token-only", ids(1, "u")))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details().startswith(
            f"no healthy encoder instance ({addr}: refused: GetInfo failed: UNAUTHENTICATED"), e.value.details()
        assert c.encode_calls() == 0 and c.lm_requests() == []

    run_cluster(body, n_encoders=1, security=tokens_for(tmp_path, "enc-A"))


def test_an_encode_refused_as_unauthenticated_is_retried_on_the_other_encoder_and_the_refuser_re_verified():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.enc_script = ["unauthenticated"]
        ident = ids(1, "v")[0]
        refuser = c.encoder_for(ident)
        other = next(e for e in c.encoders if e is not refuser)
        addr = next(a for a, f in c.by_address.items() if f is refuser)
        before, ejected = retries("encoder", "UNAUTHENTICATED"), ejections("encoder", addr)
        timings = Timings()
        out = await collect(orch, *request("r-unauth", [ident]), timings)
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        assert len(refuser.requests) == 1 and len(other.requests) == 1
        (lm_req,) = c.lm_requests()
        assert lm_req.items[0].source.transfer_endpoint == other.endpoint
        assert retries("encoder", "UNAUTHENTICATED") - before == 1 and ejections("encoder", addr) - ejected == 1
        # Its GetInfo still takes the gateway's credentials (one call was refused): admitted again.
        await wait_until(lambda: orch.health()["encoders"][addr], 3, "the re-verified encoder is re-admitted")

    run_cluster(body)


def test_an_lm_answering_permission_denied_is_retried_on_the_other_lm_and_re_admitted_once_verified():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["forbidden"]
        before = retries("lm", "PERMISSION_DENIED")
        ejected = {a: ejections("lm", a) for a in c.lm_addresses}
        timings = Timings()
        out = await collect(orch, *request("r-forbidden", []), timings)
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        calls = [who for who, what, _ in c.world.log if what == "generate"]
        assert len(calls) == 2 and calls[0] != calls[1]
        names = {f.name: a for a, f in c.by_address.items() if isinstance(f, FakeLM)}
        first, second = names[calls[0]], names[calls[1]]
        assert timings.lm == second and retries("lm", "PERMISSION_DENIED") - before == 1
        assert ejections("lm", first) - ejected[first] == 1 and ejections("lm", second) == ejected[second]
        await wait_until(lambda: orch.health()["lms"][first], 3, "the re-verified LM is re-admitted")

    run_cluster(body)


# --- errors that are never retried --------------------------------------------------------------------------------


@pytest.mark.parametrize("side, script, message, lm_calls", [
    ("encoder", "enc_script", "not an image", 0),
    ("lm", "lm_script", "prompt too long", 1),
])
def test_invalid_argument_is_raised_at_once(side, script, message, lm_calls):
    async def body(c: Cluster):
        orch = await c.start()
        setattr(c.world, script, ["invalid"])
        req, media = request(f"r-bad-{side}", ids(1, "8" if side == "encoder" else "9"))
        timings = Timings()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, req, media, timings)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
        assert c.encode_calls() == 1 and len(c.lm_requests()) == lm_calls and timings.retries == 0

    run_cluster(body)


def test_max_attempts_one_never_retries():
    async def body(c: Cluster):
        orch = await c.start(max_attempts=1)
        c.world.enc_script = ["unavailable"]
        before = retries("encoder", "UNAVAILABLE")
        req, media = request("r-once", ids(1, "a"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, req, media)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert c.encode_calls() == 1 and c.lm_requests() == []
        assert retries("encoder", "UNAVAILABLE") == before

    run_cluster(body)


# --- health: ejection, re-admission, local fallback ---------------------------------------------------------------


def test_with_every_encoder_down_the_lm_encodes_locally():
    async def body(c: Cluster):
        orch = await c.start()
        for a in c.enc_addresses:
            await c.stop_server(a)
        await wait_until(lambda: not any(orch.health()["encoders"].values()), 3, "both encoders ejected")
        before = fallbacks()
        req, media = request("r-local", ids(2, "b"))
        out = await collect(orch, req, media)
        assert tokens(out) == [1, 2, 3]
        (lm_req,) = c.lm_requests()
        assert len(lm_req.items) == 2 and not any(it.HasField("source") for it in lm_req.items)
        # The LM encodes them itself: it gets the bytes, and hashes them as vLLM does (no uuid).
        assert image_parts(lm_req) == [{"type": "image_url", "image_url": {"url": data_url(b"x")}}] * 2
        assert c.encode_calls() == 0 and fallbacks() - before == 1

    run_cluster(body)


def test_with_every_encoder_down_and_no_local_fallback_the_request_is_unavailable():
    async def body(c: Cluster):
        orch = await c.start(local_encode_fallback=False)
        for a in c.enc_addresses:
            await c.stop_server(a)
        await wait_until(lambda: not any(orch.health()["encoders"].values()), 3, "both encoders ejected")
        before = fallbacks()
        req, media = request("r-nolocal", ids(1, "c"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, req, media)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert c.lm_requests() == [] and fallbacks() == before

    run_cluster(body)


def test_an_lm_is_ejected_when_it_stops_and_re_admitted_when_it_returns():
    async def body(c: Cluster):
        orch = await c.start()
        addr = c.lm_addresses[0]
        assert orch.health()["lms"] == dict.fromkeys(c.lm_addresses, True)
        await c.stop_server(addr)
        await wait_until(lambda: orch.health()["lms"][addr] is False, 2, "the stopped LM is ejected")
        assert orch.health()["lms"][c.lm_addresses[1]] is True
        # While it is out, requests go to the other LM only.
        for n in range(3):
            await collect(orch, *request(f"r-ej{n}", []))
        assert [lm.name for lm in c.lms if lm.requests] == [c.lms[1].name]
        port = int(addr.rsplit(":", 1)[1])
        assert await c.serve(c.lms[0], port) == addr
        await wait_until(lambda: orch.health()["lms"][addr] is True, 5, "the restarted LM is re-admitted")
        # Ties between the idle LMs go by each request's key: different images, until one lands there.
        for n in range(32):
            await collect(orch, *request(f"r-back{n}", ids(1, f"back{n}")))
            if c.lms[0].requests:
                break
        assert len(c.lms[0].requests) >= 1  # back in rotation

    run_cluster(body)


def test_an_lm_that_stops_serving_is_ejected_without_going_away():
    async def body(c: Cluster):
        orch = await c.start()
        addr = c.lm_addresses[1]
        await c.servers[addr].set_serving(False)
        await wait_until(lambda: orch.health()["lms"][addr] is False, 2, "NOT_SERVING ejects")
        await c.servers[addr].set_serving(True)
        await wait_until(lambda: orch.health()["lms"][addr] is True, 2, "SERVING re-admits")

    run_cluster(body)


def test_every_lm_ejected_by_a_health_blip_is_still_tried():
    async def body(c: Cluster):
        orch = await c.start()
        for a in c.lm_addresses:
            await c.servers[a].set_serving(False)  # health says no; Generate still works
        await wait_until(lambda: not any(orch.health()["lms"].values()), 2, "both LMs ejected")
        out = await collect(orch, *request("r-blip", ids(1, "d")))
        assert tokens(out) == [1, 2, 3] and len(c.lm_requests()) == 1

    run_cluster(body)


class SlowHealth(health_pb2_grpc.HealthServicer):
    """Answers SERVING, or nothing at all while ``hang`` is set."""

    def __init__(self) -> None:
        self.hang = False

    async def Check(self, request, context):
        if self.hang:
            await asyncio.sleep(30)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_one_slow_health_check_is_forgiven_and_two_in_a_row_eject():
    """Also: two checks at once in one busy moment (the periodic check and a
    re-check after a failed call) count as one."""
    async def main():
        server = grpc.aio.server()
        fake = SlowHealth()
        health_pb2_grpc.add_HealthServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        # No health loop runs (each check is the test's); the interval sets the check's timeout, max(1 s,
        # interval): 2 s, so a good answer is never late on a busy host and two hung checks are told from one.
        pool = InstancePool("lm", [f"127.0.0.1:{port}"], lm_pb2_grpc.LMServiceStub, health_interval_s=2.0)
        try:
            (inst,) = pool.instances.values()
            await pool.check(inst)
            assert inst.healthy
            fake.hang = True
            await pool.check(inst)  # times out after 2 s: one busy moment
            assert inst.healthy
            fake.hang = False
            await pool.check(inst)  # a good answer resets the count
            fake.hang = True
            await pool.check(inst)
            assert inst.healthy
            await pool.check(inst)  # second slow check in a row
            assert not inst.healthy and "DEADLINE_EXCEEDED" in inst.reason
            fake.hang = False
            await pool.check(inst)
            assert inst.healthy
            fake.hang = True
            await asyncio.gather(pool.check(inst), pool.check(inst))  # overlapping: one busy moment
            assert inst.healthy
            fake.hang = False
            await pool.check(inst)
            assert inst.healthy and inst.reason == ""
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), TEST_LIMIT_S))


def test_a_hanging_encoder_among_two_gives_its_items_to_the_other():
    async def body(c: Cluster):
        orch = await c.start(encode_timeout_s=2.0)
        candidates = ids(64, "e")
        first = candidates[0]
        second = next(i for i in candidates if c.encoder_for(i) is not c.encoder_for(first))
        hung, survivor = c.encoder_for(first), c.encoder_for(second)
        hung.mode = "hang"
        req, media = request("r-split", [first, second])
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3]
        assert [[it.identifier for it in r.items] for r in hung.requests] == [[first]]
        assert [[it.identifier for it in r.items] for r in survivor.requests] == [[second], [first, second]]
        (lm_req,) = c.lm_requests()  # overlap waits for every encoder's metadata: the LM saw only the retry
        assert [it.source.transfer_endpoint for it in lm_req.items] == [survivor.endpoint] * 2
        assert timings.retries == 1
        await wait_until(lambda: hung.cancelled == ["r-split"], 2, "the hung Encode is cancelled")
        await assert_idle(orch)

    run_cluster(body)


def test_a_caller_cancelling_mid_encode_cancels_the_encode_and_keeps_its_request_id():
    async def body(c: Cluster):
        orch = await c.start(encode_timeout_s=30.0, request_timeout_s=30.0)  # the caller cancels first
        c.world.enc_script = ["hang"]
        req, media = request("r-gone", ids(1, "f0"))
        task = asyncio.create_task(collect(orch, req, media))
        await wait_until(lambda: any(e.requests for e in c.encoders), 2, "the Encode call arrives")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: [rid for e in c.encoders for rid in e.cancelled] == ["r-gone"], 2,
                         "the encoder sees the cancellation")
        assert c.lm_requests() == [] and req.request_id == "r-gone"
        await assert_idle(orch)

    run_cluster(body)


# --- regressions: blame, final local failures, the caller's own cancellation --------------------------------


def test_an_encoder_fault_on_a_request_spread_over_both_encoders_is_re_encoded_not_failed():
    async def body(c: Cluster):
        orch = await c.start(local_encode_fallback=False)
        candidates = ids(64)
        first = candidates[0]
        second = next(i for i in candidates if c.encoder_for(i) is not c.encoder_for(first))
        c.world.lm_script = ["encoder_unavailable"]
        req, media = request("r-both", [first, second])
        out = await collect(orch, req, media)
        assert tokens(out) == [1, 2, 3]
        assert all(it.HasField("source") for it in c.lm_requests()[-1].items)
        # Only the encoder the LM named (the first item's) was blamed: the retry sends both items to the other.
        assert [it.source.transfer_endpoint for it in c.lm_requests()[-1].items] == [c.encoder_for(second).endpoint] * 2

    run_cluster(body)


def test_no_healthy_encoder_without_local_fallback_is_not_counted_as_retries():
    async def body(c: Cluster):
        orch = await c.start(local_encode_fallback=False, max_attempts=3)
        for a in c.enc_addresses:
            await c.stop_server(a)
        await wait_until(lambda: not any(orch.health()["encoders"].values()), 3, "both encoders ejected")
        before = retries("encoder", "UNAVAILABLE")
        timings = Timings()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(orch, *request("r-none", ids(1, "f1")), timings)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert timings.retries == 0 and retries("encoder", "UNAVAILABLE") == before

    run_cluster(body)


def test_a_caller_cancelling_after_an_encoder_failure_sees_a_cancellation():
    async def body(c: Cluster):
        orch = await c.start()
        ident = ids(1, "f2")[0]
        c.world.enc_script = ["fail_when_released"]
        c.world.lm_script = ["first_then_block"]  # the LM already has the embedding; tokens flow
        req, media = request("r-cx", [ident])
        got: list[lm_pb2.GenerateResponse] = []

        async def consume():
            async for r in generate(orch, req, media, Timings()):
                got.append(r)

        task = asyncio.create_task(consume())
        await wait_until(lambda: got, 2, "the first token")
        c.world.release.set()  # the encoder dies now; the LM does not care
        enc = next(i for i in orch.encoders.instances.values() if c.by_address[i.address] is c.encoder_for(ident))
        await wait_until(lambda: enc.outstanding == 0, 2, "the gateway saw the encoder fail")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    run_cluster(body)


def test_an_encoder_fault_the_lm_cannot_attribute_re_encodes_without_excluding_healthy_encoders():
    async def body(c: Cluster):
        orch = await c.start(local_encode_fallback=False)
        c.world.lm_script = ["encoder_unavailable_unnamed"]
        ident = ids(1, "f3")[0]
        req, media = request("r-unnamed", [ident])
        timings = Timings()
        out = await collect(orch, req, media, timings)
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        assert all(it.HasField("source") for it in c.lm_requests()[-1].items)
        aff = c.encoder_for(ident)  # nobody to blame: the retry re-encodes on the same (healthy) encoder
        assert len(aff.requests) == 2 and c.encode_calls() == 2
        assert c.lm_requests()[-1].items[0].source.transfer_endpoint == aff.endpoint

    run_cluster(body)


def test_a_request_pinned_to_an_lm_goes_there_and_nowhere_else():
    """A request about a stored response (``lm=``: the LM that holds it) goes to that LM every time;
    with it gone, the request fails at once (503) rather than reaching an LM that never saw it."""
    async def body(c: Cluster):
        orch = await c.start()
        for target in c.lm_addresses:
            for n in range(3):
                req, media = request(f"r-pin-{n}", [])
                out = [r async for r in orch.generate(req, media, Timings(), lm=target,
                                                      body=lm_body(orch, req, media))]
                assert tokens(out) == [1, 2, 3]
            assert [len(lm.requests) for lm in c.lms][c.lm_addresses.index(target)] == 3
        await c.stop_server(c.lm_addresses[0])
        req, media = request("r-pin-gone", [])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in orch.generate(req, media, Timings(), lm=c.lm_addresses[0],
                                                body=lm_body(orch, req, media))]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(c.lms[1].requests) == 3  # not sent elsewhere

    run_cluster(body)
