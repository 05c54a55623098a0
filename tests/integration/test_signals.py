"""The scaling signals move as a scaler reads them, through the services' own code: the encoder's queue
depth rises while an Encode call's items wait for the engine and its busy seconds grow while the engine
runs (the real ``EncoderServicer``, its real media decoder, a stand-in engine held until the test lets it
finish), and the gateway's objective attainment on its internal metrics port counts the requests it
finished (the whole gateway, ``server.serve``, against the fake encoder and LM; and ``--workers 2``, whose
page merges the workers' windows). vLLM's own LM series and
the LM's waiting count on a real deployment: tests/e2e/test_signals.py. Every wait is a poll with a
bounded deadline; ports are the OS's choice or ``free_port``'s."""

from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ectransfer.connector.metadata import ProducerFinished
from epd.encoder.v1 import encoder_pb2
from services.common.media import MediaConfig, MediaDecoder
from services.up import free_port
from tests.integration.gateway_fakes import FakeEncoder, FakeLM, World, serve_fake
from tests.integration.gateway_harness import Gateway, chat
from tools.media import make_image

pytestmark = pytest.mark.integration

TEST_LIMIT_S = 120.0  # a hang guard


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


class _HeldEngine:
    """What ``EncoderServicer.Encode`` uses of vLLM's AsyncLLM: an input processor that makes a request
    with no features, and a ``generate`` that sets ``started`` and holds until ``finish`` is set, then
    answers one finished output with the producer's report (no vision run)."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(is_encoder_decoder=False,
                                            multimodal_config=SimpleNamespace(get_limit_per_prompt=lambda m: 4))
        self.input_processor = self
        self.renderer = None
        self.started, self.finish = asyncio.Event(), asyncio.Event()

    async def get_supported_tasks(self):
        return ("generate",)

    async def process_inputs_async(self, rid, prompt, params, supported_tasks=()):
        return SimpleNamespace(mm_features=[], prompt_token_ids=[1])

    async def generate(self, request, params, rid):
        self.started.set()
        await self.finish.wait()
        yield SimpleNamespace(finished=True, outputs=[], ec_transfer_params=ProducerFinished().to_dict())

    async def abort(self, rid):
        pass


async def poll(read, done, what: str, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not done(value := read()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what} (last: {value})")
        await asyncio.sleep(0.02)
    return value


def test_the_encoders_queue_depth_holds_waiting_items_and_its_busy_seconds_grow_while_the_engine_runs():
    from services.encoder.servicer import EncoderServicer

    async def body():
        engine = _HeldEngine()
        servicer = EncoderServicer(engine, encoder_pb2.EncoderInfo(), {"image": lambda i: "<image>"}, {"": 8},
                                   dtype=0, timeout_s=60, decoder=MediaDecoder(MediaConfig()), layouts=False)
        image = make_image(3, (16, 16))
        request = encoder_pb2.EncodeRequest(request_id="sig-1", items=[
            encoder_pb2.MediaItem(modality="image", data=image), encoder_pb2.MediaItem(modality="image", data=image)])
        depth0, busy0, items0 = sample("epd_encoder_queue_depth"), sample("epd_encoder_busy_seconds_total"), \
            sample("epd_encoder_items_total")

        async def run():
            return [e async for e in servicer.Encode(request, None)]

        call = asyncio.create_task(run())
        await asyncio.wait_for(engine.started.wait(), 60)
        assert sample("epd_encoder_queue_depth") == depth0 + 2  # both items wait on the engine
        assert sample("epd_encoder_items_total") == items0 + 2
        busy_mid = await poll(lambda: sample("epd_encoder_busy_seconds_total"), lambda v: v > busy0,
                              "the busy seconds grow while the engine runs")
        engine.finish.set()
        await asyncio.wait_for(call, 60)
        assert sample("epd_encoder_queue_depth") == depth0
        assert sample("epd_encoder_busy_seconds_total") >= busy_mid
        idle = sample("epd_encoder_busy_seconds_total")
        await asyncio.sleep(0.05)
        assert sample("epd_encoder_busy_seconds_total") == idle  # idle: no more busy seconds

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def test_an_encode_the_caller_abandons_leaves_nothing_in_the_queue_depth():
    from services.encoder.servicer import EncoderServicer

    async def body():
        engine = _HeldEngine()
        servicer = EncoderServicer(engine, encoder_pb2.EncoderInfo(), {"image": lambda i: "<image>"}, {"": 8},
                                   dtype=0, timeout_s=60, decoder=MediaDecoder(MediaConfig()), layouts=False)
        request = encoder_pb2.EncodeRequest(request_id="sig-2", items=[
            encoder_pb2.MediaItem(modality="image", data=make_image(4, (16, 16)))])
        depth0 = sample("epd_encoder_queue_depth")
        events = servicer.Encode(request, None)
        call = asyncio.create_task(anext(events, None))
        await asyncio.wait_for(engine.started.wait(), 60)
        assert sample("epd_encoder_queue_depth") == depth0 + 1
        call.cancel()  # the client went away while the engine ran
        with pytest.raises(asyncio.CancelledError):
            await call
        await events.aclose()
        assert sample("epd_encoder_queue_depth") == depth0

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def _samples(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``objective`` label ("" for none)."""
    return {s.labels.get("objective", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_the_gateways_internal_port_shows_the_share_of_finished_requests_that_met_each_objective():
    async def body():
        world = World()
        servers = [await serve_fake(FakeLM("lm", world)), await serve_fake(FakeEncoder("enc", world, 0.5))]
        (_, lm_addr), (_, enc_addr) = servers
        internal = free_port()
        try:
            # The fake LM reports 1 ms to its first token and 0.5 ms per token after it: every request misses
            # a 0.5 ms TTFT objective and meets the 200 ms TPOT one.
            async with Gateway(lms=lm_addr, encoders=enc_addr, metrics_port=internal, objective_ttft_ms=0.5,
                               objective_tpot_ms=200, objective_window_s=600) as gw:
                await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200, 30, "the LM admitted")
                url = f"http://127.0.0.1:{internal}/metrics"
                async with aiohttp.ClientSession() as http:
                    async with http.get(url) as r:
                        before = await r.text()
                    assert _samples(before, "epd_gateway_objective_attainment") == {"ttft": 1.0, "tpot": 1.0,
                                                                                    "both": 1.0}  # nothing yet
                    for _ in range(3):
                        status, answer, _ = await gw.post("/v1/chat/completions", chat())
                        assert status == 200, answer
                    async with http.get(url) as r:
                        after = await r.text()
                assert _samples(after, "epd_gateway_objective_window_requests") == {"": 3.0}
                assert _samples(after, "epd_gateway_objective_attainment") == {"ttft": 0.0, "tpot": 1.0, "both": 0.0}
                assert _samples(after, "epd_gateway_objective_window_met") == {"ttft": 0.0, "tpot": 3.0, "both": 0.0}
        finally:
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))


def test_with_workers_the_merged_page_counts_every_workers_window_and_shows_one_attainment_per_objective(tmp_path):
    """``--workers 2`` (subprocesses, a stub LM): the window's counts are summed over the live workers and
    the attainment is one series per objective (the lowest worker's), none per process."""
    from tests.integration.gateway_processes import StubLM, WorkersGateway, poll

    chats = 8  # each on a connection of its own: the kernel spreads them over the workers
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        for _ in range(chats):
            status, body = gw.call("POST", "/v1/chat/completions", chat())
            assert status == 200, body
        poll(lambda: gw.metric("epd_gateway_objective_window_requests"), lambda v: v == chats,
             "every worker's finished chats in the merged window")
        with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=60) as r:
            page = r.read().decode()
    attainment = [s for f in text_string_to_metric_families(page) for s in f.samples
                  if s.name == "epd_gateway_objective_attainment"]
    assert sorted(s.labels["objective"] for s in attainment) == ["both", "tpot", "ttft"]
    assert all(set(s.labels) == {"objective"} and 0.0 <= s.value <= 1.0 for s in attainment)
