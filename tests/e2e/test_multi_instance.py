"""Issue 5 must-show with 2 encoders and 2 LMs behind one gateway: repeated
images go to the same encoder (cache affinity), LMs share the load, and an
encoder killed mid-run costs retries, never a failed request or a hang, and its images go to the
other; once restarted it is re-admitted and used again (slow tier)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from epd.encoder.v1 import encoder_pb2_grpc
from epd.lm.v1 import lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from services.common.media import content_id
from services.gateway.routing import pick_encoder
from services.up import Deployment, grpc_serving
from tests.e2e.conftest import REFERENCE_REQUESTS, stop_in_background
from tests.e2e.helpers import image_bytes, metric, post, producer_stats, settled, text_chat

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def multi(tiny_model):
    # Health checks every 3 s (timeout 3 s): an instance is ejected as slow after two timeouts in a row,
    # so the frozen encoder below stays admitted at least 9 s, and a check slowed by a loaded host
    # does not eject a working one.
    # A host tier of 8 KiB per encoder (a tiny-model image's output is 4 KiB): a few images evict it.
    # Stored responses on (previous_response_id), as the session's deployment and the parity module's `vllm serve`.
    dep = Deployment(model=tiny_model, quiet=True, n_encoders=2, n_lms=2, encoder_args=["--host-tier-mib", "0.008"],
                     gateway_args=["--health-interval-s", "3"], env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    dep.start()  # ready once the gateway has admitted all four (routing by affinity needs both encoders)
    yield dep
    stop_in_background(dep)


def _health(dep) -> dict:
    with urllib.request.urlopen(dep.url + "/health", timeout=30) as r:
        return json.loads(r.read())


def _encoder_calls(dep) -> list[float]:
    return [metric(dep.gateway_metrics, "epd_gateway_instance_calls_total", role="encoder", instance=e.address)
            for e in dep.encoders]


def _affine(dep, name: str) -> int:
    """Which encoder the gateway's routing maps this request's image to (same code as the gateway)."""
    ident = content_id(image_bytes(REFERENCE_REQUESTS[name]))
    fakes = [SimpleNamespace(address=e.address, outstanding=0) for e in dep.encoders]
    return fakes.index(pick_encoder(ident, fakes, spill=4))


def test_repeated_image_goes_to_the_same_encoder_and_lms_share_load(multi, reference):
    lm_before = [metric(lm.metrics_port, "epd_lm_requests_total") for lm in multi.lms]
    answered_by = set()
    for name in ("multi0", "multi1"):
        want = _affine(multi, name)
        before = _encoder_calls(multi)
        for _ in range(3):
            status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == reference[name]
            assert body["epd"]["encoders"] == [multi.encoders[want].address]
            answered_by.add(body["epd"]["lm"])
        after = _encoder_calls(multi)
        assert [a - b for a, b in zip(after, before)] == [3 if i == want else 0 for i in range(2)], name
    # Sequential requests find both LMs idle; a tie goes by the request's key (rendezvous hashing, the same
    # on every gateway replica), so different requests spread: if the two images' did not, a few different
    # text requests do. Both LMs served some (an LM counts a call as it ends, which can trail the answer).
    for n in range(32):
        if len(answered_by) == len(multi.lms):
            break
        status, body = post(multi.url + "/v1/chat/completions", text_chat(f"Say {n}.", max_tokens=1))
        assert status == 200, body
        answered_by.add(body["epd"]["lm"])
    def lm_after():
        return [metric(lm.metrics_port, "epd_lm_requests_total") for lm in multi.lms]
    assert settled(lambda: all(a > b for a, b in zip(lm_after(), lm_before)), True), (lm_before, lm_after())


def _holdings(dep, address: str, stub=lm_pb2_grpc.LMServiceStub) -> list[str]:
    """What the LM (or, with ``stub``, the encoder) at ``address`` answers to Holdings."""
    with dep.client_security.channel(address) as ch:
        return list(stub(ch).Holdings(transfer_pb2.HoldingsRequest(generation=-1), timeout=10).items)


def _fleet(dep, what: str) -> float:
    """``what`` summed over the deployment's encoders: a Transfer Stats field, or their vision runs."""
    if what == "vision_runs":
        return sum(metric(e.metrics_port, "epd_encoder_vision_runs_total") for e in dep.encoders)
    return sum(producer_stats(dep, e.address)[what] for e in dep.encoders)


def test_a_conversations_next_turns_land_on_the_lm_that_holds_its_image(multi, reference):
    """Issue 33: each turn re-sends the history; turns after the first go to the LM whose prefix cache holds
    the conversation's image (the gateway's directory: what it sent, then the LM's Holdings), and every
    answer is plain vLLM's. The LM's Holdings come from vLLM's own KV cache events and name the image.
    Each image is encoded once fleet-wide: the later turns' Encodes go to the encoder that holds the output
    and claim the copy its store holds (its host tier keeps it once the previous turn's LM is done)."""
    runs, reused = _fleet(multi, "vision_runs"), _fleet(multi, "reuse_hits")
    held = metric(multi.gateway_metrics, "epd_gateway_lm_routing_total", decision="held")
    enc_held = metric(multi.gateway_metrics, "epd_gateway_encoder_routing_total", decision="held")
    encoders: dict[int, list[str]] = {}
    hits = {lm.address: metric(lm.metrics_port, "vllm:prefix_cache_hits_total") for lm in multi.lms}
    homes: dict[int, str] = {}
    for c in range(2):
        for t in range(3):
            name = f"conv{c}_{t}"
            status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == reference[name], name
            assert body["epd"]["lm"] == homes.setdefault(c, body["epd"]["lm"]), (name, homes, body["epd"])
            assert body["epd"]["encoders"] == encoders.setdefault(c, body["epd"]["encoders"]), (name, body["epd"])
    assert metric(multi.gateway_metrics, "epd_gateway_lm_routing_total", decision="held") - held == 4
    # The later turns' images went to the encoder that holds their output (what the gateway sent it, then
    # its Holdings: its outbound store and host tier).
    assert metric(multi.gateway_metrics, "epd_gateway_encoder_routing_total", decision="held") - enc_held == 4
    for home in set(homes.values()):  # the later turns found their prefix there (vLLM's own count, in tokens)
        assert metric(next(lm for lm in multi.lms if lm.address == home).metrics_port,
                      "vllm:prefix_cache_hits_total") > hits[home], home
    for c, home in homes.items():
        ident = content_id(image_bytes(REFERENCE_REQUESTS[f"conv{c}_0"]))
        assert settled(lambda i=ident, h=home: i in _holdings(multi, h), True), (c, home)  # events arrive in the background
    assert settled(lambda: _fleet(multi, "vision_runs") - runs, 2) == 2, "each image encoded once, fleet-wide"
    # Turns 2 and 3 claimed the copy the encoder's store holds: kept in its host tier, or still held when the
    # last turn's LM has not settled its claim yet (a tier hit or not is a matter of timing; no encode either way).
    assert settled(lambda: _fleet(multi, "reuse_hits") - reused, 4) == 4
    for c, (encoder,) in encoders.items():
        ident = content_id(image_bytes(REFERENCE_REQUESTS[f"conv{c}_0"]))
        assert ident in _holdings(multi, encoder, encoder_pb2_grpc.EncoderServiceStub), (c, encoder)


def test_a_text_only_conversations_next_turns_land_on_the_lm_that_holds_its_prefix(multi, reference):
    """Issue 33: a conversation without media is routed by its prefix keys (services/fleet_memory/prefix.py):
    turns after the first go to the LM whose prefix cache holds the history, which lists the first turn's key
    in its Holdings from vLLM's own KV events (the key is the request's session_id), and every answer is
    plain vLLM's."""
    held = metric(multi.gateway_metrics, "epd_gateway_lm_routing_total", decision="held")
    before = {lm.address: set(_holdings(multi, lm.address)) for lm in multi.lms}
    home = None
    for t in range(3):
        status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[f"tconv_{t}"])
        assert status == 200 and body["choices"][0]["token_ids"] == reference[f"tconv_{t}"], body
        home = home or body["epd"]["lm"]
        assert body["epd"]["lm"] == home, (t, home, body["epd"])
        if t == 0:  # the first turn's key, from the LM's events (its prompt fills two whole blocks)
            assert settled(lambda h=home: any(k.startswith("p:") for k in set(_holdings(multi, h)) - before[h]), True)
    assert metric(multi.gateway_metrics, "epd_gateway_lm_routing_total", decision="held") - held == 2


def _responses_turns(url: str, model: str, image: str) -> list[dict]:
    """A Responses conversation of two turns: an image with a long question (it fills a KV block), then a
    follow-up naming the first response (vLLM renders its stored input again)."""
    turns = []
    for body in ({"input": [{"role": "user", "content": [
                     {"type": "input_image", "image_url": image},
                     {"type": "input_text", "text": "Remember this picture. " + "Describe every shape and colour in it. " * 20}]}]},
                 {"input": "What was in it?"}):
        if turns:
            body["previous_response_id"] = turns[-1]["id"]
        status, answer = post(url + "/v1/responses", {"model": model, "temperature": 0, "max_output_tokens": 6, **body})
        assert status == 200, answer
        turns.append(answer)
    return turns


def _texts(answer: dict) -> list[str]:
    return [c.get("text") for item in answer["output"] if item.get("type") == "message" for c in item["content"]]


def test_a_responses_follow_up_goes_to_the_lm_that_stored_it_and_is_answered_as_by_one_lm(multi, deployment):
    """Issue 33, via previous_response_id on 2 LMs: the follow-up goes to the LM that stored the first response
    (its home), finds its image there (no vision run anywhere, fleet-wide), and both answers are the session
    deployment's (one LM, which tests/e2e/test_openai_parity.py holds to `vllm serve`'s on the same turns)."""
    from tools.media import data_url, make_image

    image = data_url(make_image(640, (224, 224)))
    model = json.loads(urllib.request.urlopen(multi.url + "/v1/models", timeout=30).read())["data"][0]["id"]
    def lms(name: str) -> list[float]:
        return [metric(lm.metrics_port, name) for lm in multi.lms]

    calls, local, runs = lms("epd_lm_requests_total"), lms("epd_lm_local_encoder_runs_total"), _fleet(multi, "vision_runs")
    first, follow = _responses_turns(multi.url, model, image)
    # Both turns on one LM (an LM counts a call as it ends, which can trail the answer).
    assert settled(lambda: sorted(a - b for a, b in zip(lms("epd_lm_requests_total"), calls)), [0, 2]) == [0, 2]
    # The first turn's image encoded once, on an encoder; the follow-up's found in its home's prefix cache.
    assert settled(lambda: _fleet(multi, "vision_runs") - runs, 1) == 1
    assert lms("epd_lm_local_encoder_runs_total") == local
    one = json.loads(urllib.request.urlopen(deployment.url + "/v1/models", timeout=30).read())["data"][0]["id"]
    assert [_texts(a) for a in (first, follow)] == [_texts(a) for a in _responses_turns(deployment.url, one, image)]


def test_the_host_tier_evicting_under_load_costs_a_re_encode_never_an_error(multi, reference):
    """Issue 33: an image, then 12 other images at once (each encoder's tier holds two), then the first
    image again: the tier evicted under load, and every answer is plain vLLM's; nothing stays held."""
    evictions = _fleet(multi, "tier_evictions")
    names = ["image0", *(f"burst{i}" for i in range(12)), "image0"]

    def ask(name):
        status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
        assert status == 200, body
        return body["choices"][0]["token_ids"] == reference[name]

    assert ask(names[0])
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(ask, names[1:-1]))
    assert ask(names[-1])
    assert settled(lambda: _fleet(multi, "tier_evictions") > evictions, True)  # acks land in the background
    assert settled(lambda: _fleet(multi, "items_held") + _fleet(multi, "pending_reservations"), 0) == 0


def test_kill_one_encoder_mid_run_every_request_succeeds_and_its_images_go_to_the_other(multi, reference):
    victim = multi.encoders[0]
    names = [f"multi{i}" for i in range(8)]
    assert any(_affine(multi, n) == 0 for n in names), "some image maps to the victim"
    retries = metric(multi.gateway_metrics, "epd_gateway_retries_total")
    # Frozen first, so the encodes routed to it are surely in flight when it dies (a tiny
    # model's encode, or a reused one, can otherwise finish between two polls). It is
    # killed long before the gateway's health checks would find it slow (two 3 s timeouts in a
    # row: at least 9 s after the freeze, however long the requests take to reach it).
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(post, multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[n], 90)
                   for n in names}
        deadline = time.monotonic() + 30
        while metric(multi.gateway_metrics, "epd_gateway_instance_outstanding", role="encoder",
                     instance=victim.address) < 1:
            assert time.monotonic() < deadline, "the victim never had an encode in flight"
            time.sleep(0.02)
        os.killpg(victim.proc.pid, signal.SIGKILL)  # service and engine, no cleanup
        t0 = time.monotonic()
        results = {n: f.result(timeout=120) for n, f in futures.items()}
    assert time.monotonic() - t0 < 60  # no hang
    for n, (status, body) in results.items():
        assert status == 200, (n, body)
        assert body["choices"][0]["token_ids"] == reference[n], n
        assert victim.address not in body["epd"]["encoders"], (n, body["epd"])  # frozen, then dead: it served none
    assert metric(multi.gateway_metrics, "epd_gateway_retries_total") > retries, "in-flight requests were retried"

    deadline = time.monotonic() + 30
    while _health(multi)["encoders"][victim.address]:
        assert time.monotonic() < deadline, "the dead encoder was never ejected"
        time.sleep(0.2)
    # While it is out, its images go to the other encoder (once that one is admitted: on a
    # loaded host the burst above can make its health checks slow for a moment).
    deadline = time.monotonic() + 30
    while not _health(multi)["encoders"][multi.encoders[1].address]:
        assert time.monotonic() < deadline, "the surviving encoder stayed ejected"
        time.sleep(0.2)
    name = next(n for n in names if _affine(multi, n) == 0)
    status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
    assert status == 200 and body["epd"]["encoders"] == [multi.encoders[1].address], body


def test_the_lm_that_held_a_conversation_killed_costs_its_next_turn_one_miss_and_an_exact_answer(multi, reference):
    """Issue 33: the directory still names a dead LM until the pool drops it; the next turn is routed there
    or to the other LM, and either way answered exactly by the other one (a retry, or a miss: the prompt
    computed from scratch, the image transferred again)."""
    status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS["conv2_0"])
    assert status == 200 and body["choices"][0]["token_ids"] == reference["conv2_0"], body
    home = next(lm for lm in multi.lms if lm.address == body["epd"]["lm"])
    status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS["conv2_1"])
    assert status == 200 and body["epd"]["lm"] == home.address and \
        body["choices"][0]["token_ids"] == reference["conv2_1"], body
    os.killpg(home.proc.pid, signal.SIGKILL)  # service and engine, no cleanup
    home.proc.wait()
    status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS["conv2_2"])
    assert status == 200, body
    assert body["epd"]["lm"] != home.address and body["choices"][0]["token_ids"] == reference["conv2_2"], body


@pytest.mark.slow  # a vLLM start of its own; in the default run test_engine_death restarts a killed encoder
# (exact tokens after), and tests/integration/test_gateway_failover.py re-admits an instance that comes back
# (an LM there; encoders and LMs share InstancePool)
def test_a_killed_encoder_started_again_is_readmitted_and_used_again(multi, reference):
    victim = multi.encoders[0]
    if victim.alive():  # run alone: the test above did not kill it
        os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    # An image no earlier test sent (the other encoder's host tier may hold those), affine to the victim.
    name = next(n for n in (f"dns{i}" for i in range(16)) if _affine(multi, n) == 0)
    victim.start(dict(os.environ))
    deadline = time.monotonic() + 240
    while (not grpc_serving(victim.address, security=multi.client_security)
           or not _health(multi)["encoders"][victim.address]):
        assert victim.alive() and time.monotonic() < deadline, victim.log_tail()
        time.sleep(0.5)
    status, body = post(multi.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
    assert status == 200, body
    assert body["epd"]["encoders"] == [victim.address] and body["choices"][0]["token_ids"] == reference[name]
    # The restarted process served it (its counter may trail the answer by a scheduling slice).
    assert settled(lambda: metric(victim.metrics_port, "epd_encoder_requests_total"), 1) == 1
