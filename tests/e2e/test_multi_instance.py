"""Issue 5 must-show with 2 encoders and 2 LMs behind one gateway: repeated
images go to the same encoder (cache affinity), LMs share the load, and an
encoder killed mid-run costs retries, never a failed request or a hang, and its images go to the
other; once restarted it is re-admitted and used again (slow tier).

The same engines serve extra gateway processes (tests/e2e/replicas.py; no engine of their own): two
replicas sharing one state store, secret and keys file, whose stored responses, places and
--lm-max-outstanding hold for the whole front door (also with a replica killed and the store stopped),
and a gateway with --workers 2 that answers every route as the deployment's own gateway does."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from epd.encoder.v1 import encoder_pb2_grpc
from epd.lm.v1 import lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from services.cli import default_model
from services.common.media import content_id
from services.gateway.routing import pick_encoder
from services.probe import gateway_admitted
from services.up import Deployment, grpc_serving
from tests import ahead
from tests.e2e.conftest import REFERENCE_REQUESTS, stop_in_background
from tests.e2e.helpers import (
    TEARDOWN_DRAIN_S,
    image_bytes,
    image_chat,
    metric,
    post,
    producer_stats,
    settled,
    text_chat,
)
from tests.e2e.replicas import LEASE_S, ExtraGateway, Replicas
from tests.integration.gateway_processes import poll

pytestmark = [pytest.mark.e2e]


def _deployment() -> Deployment:
    # Health checks every 3 s (timeout 3 s): an instance is ejected as slow after two timeouts in a row,
    # so the frozen encoder below stays admitted at least 9 s, and a check slowed by a loaded host
    # does not eject a working one.
    # A host tier of 8 KiB per encoder (a tiny-model image's output is 4 KiB): a few images evict it.
    # Stored responses on (previous_response_id), as the session's deployment and the parity module's `vllm serve`.
    return Deployment(model=default_model(), quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, n_encoders=2, n_lms=2,
                      encoder_args=["--host-tier-mib", "0.008"], gateway_args=["--health-interval-s", "3"],
                      env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})


ahead.register(__name__, "multi", _deployment)


@pytest.fixture(scope="module")
def multi(tiny_model):
    # Ready once the gateway has admitted all four (routing by affinity needs both encoders).
    dep = ahead.take(__name__) or _deployment().start()
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


# --- Two gateway replicas, and a gateway with --workers 2, in front of these engines ---------------------------
# Extra gateway processes (tests/e2e/replicas.py) over this module's encoders and LMs: no engine of their own.
# The replicas serve the first encoder and both LMs, share a private store, one state secret and one keys file
# (alice: max_in_flight 1), and hold --lm-max-outstanding 2 for the whole front door.


@pytest.fixture(scope="module")
def replicas(multi, tmp_path_factory):
    with Replicas(multi, tmp_path_factory.mktemp("replicas")) as pair:
        yield pair


def _model(dep) -> str:
    return json.loads(urllib.request.urlopen(dep.url + "/v1/models", timeout=30).read())["data"][0]["id"]


def _one_gateway_turns(dep, first: dict, follow: dict) -> tuple[dict, dict]:
    """The deployment's own gateway's answers to ``first`` and to ``follow`` naming it (no keys there)."""
    status, one = post(dep.url + "/v1/responses", first)
    assert status == 200, one
    status, two = post(dep.url + "/v1/responses", {**follow, "previous_response_id": one["id"]})
    assert status == 200, two
    return one, two


def test_a_response_stored_through_one_replica_is_read_cancelled_and_continued_through_the_other_and_a_restarted_one(
        multi, replicas):
    """The id carries its home LM and its owner under the replicas' one secret: replica 1, and replica 0
    after a kill -9 and a restart (no memory of what it minted), read the stored response, continue it on
    its home LM and cancel a background one; every answer is the deployment's own gateway's for the same
    conversation (greedy). Another tenant gets 404 through every replica."""
    from tools.media import data_url, make_image

    model, one, two = _model(multi), replicas.live(0), replicas.live(1)
    first = {"model": model, "temperature": 0, "max_output_tokens": 6, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(make_image(641, (224, 224)))},
        {"type": "input_text", "text": "Remember this picture. " + "Describe every shape and colour in it. " * 20}]}]}
    follow = {"model": model, "temperature": 0, "max_output_tokens": 6, "input": "What was in it?"}
    want_first, want_follow = _one_gateway_turns(multi, first, follow)
    status, made = one.call("POST", "/v1/responses", first, "carol")
    assert status == 200 and _texts(made) == _texts(want_first), made
    # A background response, cancelled through replica 1 at once: vLLM's answer, from its home LM.
    status, queued = one.call("POST", "/v1/responses", {"model": model, "temperature": 0, "max_output_tokens": 900,
                                                         "ignore_eos": True, "background": True,
                                                         "input": "Count the waves."}, "carol")
    assert status == 200 and queued["status"] in ("queued", "in_progress"), queued
    status, cancelled = two.call("POST", f"/v1/responses/{queued['id']}/cancel", {}, "carol")
    if status == 200:
        assert cancelled["id"] == queued["id"] and cancelled["status"] == "cancelled", cancelled
    else:  # it ended before the cancel came (a fast host): vLLM's refusal, from the LM that holds it
        assert status == 400 and "Cannot cancel" in json.dumps(cancelled), (status, cancelled)
    ended = "cancelled" if status == 200 else "completed"

    def served(replica) -> None:
        status, read = replica.call("GET", f"/v1/responses/{made['id']}", None, "carol")
        assert status == 200 and read["id"] == made["id"] and _texts(read) == _texts(made), read
        status, cont = replica.call("POST", "/v1/responses", {**follow, "previous_response_id": made["id"]}, "carol")
        assert status == 200 and _texts(cont) == _texts(want_follow), cont
        assert cont["epd"]["lm"] == made["epd"]["lm"], (cont["epd"], made["epd"])  # its home LM
        status, bg = poll(lambda: replica.call("GET", f"/v1/responses/{queued['id']}", None, "carol"),
                          lambda r: r[0] != 200 or r[1]["status"] == ended, "the background response ended")
        assert status == 200 and bg["status"] == ended, bg
        for rid in (made["id"], queued["id"]):  # another tenant: as if it did not exist
            status, answer = replica.call("GET", f"/v1/responses/{rid}", None, "bob")
            assert status == 404, answer

    served(two)
    served(replicas.restart(0))


def test_alice_holds_one_place_across_both_replicas_and_a_replica_killed_holding_it_gives_it_back(multi, replicas):
    """alice's max_in_flight 1 is one place for the front door: while her image request waits on the (frozen)
    encoder through replica 0, replica 1 refuses her at once, and her request is then answered as the
    deployment's own gateway answers it: [200, 429]. Replica 0 killed with kill -9 while it holds her place:
    replica 1 admits her again once its lease (``LEASE_S``) has run out; the poll's deadline is a hang guard."""
    encoder = multi.encoders[0]
    ask = text_chat("Say something.", max_tokens=2)
    try:
        with ThreadPoolExecutor(1) as pool:
            body, first = _held_on_frozen_encoder(pool, replicas.live(0), encoder, 650)
            status, refused = replicas.live(1).call("POST", "/v1/chat/completions", ask, "alice", timeout=60)
            os.killpg(encoder.proc.pid, signal.SIGCONT)
            got, want = first.result(), post(multi.url + "/v1/chat/completions", body)
            assert [got[0], status] == [200, 429] and "max_in_flight" in json.dumps(refused), (got, refused)
            assert got[1]["choices"][0]["token_ids"] == want[1]["choices"][0]["token_ids"]

            _, doomed = _held_on_frozen_encoder(pool, replicas.live(0), encoder, 651)
            replicas.live(0).kill()
            os.killpg(encoder.proc.pid, signal.SIGCONT)
            with pytest.raises(OSError):
                doomed.result()
            poll(lambda: replicas.live(1).call("POST", "/v1/chat/completions", ask, "alice")[0], lambda s: s == 200,
                 "the killed replica's place back", timeout=LEASE_S + 60)
    finally:
        os.killpg(encoder.proc.pid, signal.SIGCONT)
        # The tests after these need every instance admitted by the deployment's own gateway again.
        poll(lambda: gateway_admitted(multi.url, [e.address for e in multi.encoders], [lm.address for lm in multi.lms],
                                      metrics_url=f"http://127.0.0.1:{multi.gateway_metrics}/metrics"),
             bool, "the deployment's gateway admitting every instance")


def _held_on_frozen_encoder(pool, replica, encoder, seed: int):
    """Freezes ``encoder`` (SIGSTOP; the caller sends SIGCONT) and sends alice's image chat through
    ``replica`` on ``pool``; returns (its body, its future) once the replica has it encoding, so holding
    her place."""
    body = image_chat(seed, max_tokens=6)
    os.killpg(encoder.proc.pid, signal.SIGSTOP)
    future = pool.submit(replica.call, "POST", "/v1/chat/completions", body, "alice")
    poll(lambda: replica.metric("epd_gateway_instance_outstanding", role="encoder"), lambda n: n >= 1,
         "alice's request admitted and encoding")
    return body, future


def _queued_in_vllm(lm) -> float:
    """What vLLM's own metrics on this LM count now: requests running plus waiting (one read of its page)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{lm.metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def test_under_load_from_both_replicas_the_lms_run_no_more_than_the_front_doors_places(multi, replicas):
    """12 chats at once, half through each replica: --lm-max-outstanding 2 is 2 places on each LM for the
    whole front door (without the store each replica would send 2 to each). vLLM's own gauges, read
    throughout the load, never count more than 2 on either LM, plus 1 for a request the gateway has let go
    that vLLM's last step still counted."""
    one, two = replicas.live(0), replicas.live(1)
    bodies = [{**text_chat(f"Count to {n}.", max_tokens=96), "ignore_eos": True} for n in range(12)]
    seen: list[list[float]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append([_queued_in_vllm(lm) for lm in multi.lms])

    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        watcher = pool.submit(watch)
        try:
            answers = list(pool.map(lambda i: (one, two)[i % 2].call("POST", "/v1/chat/completions", bodies[i], "bob"),
                                    range(len(bodies))))
        finally:
            done.set()
            watcher.result()
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    assert max(sum(s) for s in seen) >= 1, seen  # the watch saw the load
    assert max(max(s) for s in seen) <= 2 + 1, seen
    status, want = post(multi.url + "/v1/chat/completions", bodies[0])
    assert status == 200 and answers[0][1]["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_with_the_store_stopped_each_replica_decides_on_its_own_part_and_on_the_store_once_it_is_back(replicas):
    """docs/design.md, "State shared across gateway processes": with the store unreachable each of the N = 2
    processes holds its part of every limit and says so (epd_gateway_state_store_shared 0): alice's one place
    is replica 0's part, so replica 1 holds her request in its queue; other tenants are served through both.
    The store back (restarted empty), the replicas decide there again and her request is admitted."""
    one, two = replicas.live(0), replicas.live(1)
    replicas.store.stop(remove=False)
    ask = text_chat("Say something.", max_tokens=2)
    assert one.call("POST", "/v1/chat/completions", ask, "alice")[0] == 200
    for replica in (one, two):
        assert replica.call("POST", "/v1/chat/completions", ask, "bob")[0] == 200
        assert poll(lambda r=replica: r.metric("epd_gateway_state_store_shared"), lambda v: v == 0,
                    "the replica on its part") == 0
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(two.call, "POST", "/v1/chat/completions", ask, "alice")
        poll(lambda: two.metric("epd_gateway_admission_waiting"), lambda n: n >= 1, "alice waiting on replica 1")
        assert not waiting.done()  # replica 1's part of her one place is none: she waits (--admission-wait-s)
        replicas.store.start()
        assert waiting.result()[0] == 200
    for replica in (one, two):
        assert poll(lambda r=replica: r.metric("epd_gateway_state_store_shared"), lambda v: v == 1,
                    "the replica on the store again") == 1


def _streamed_text(sse: str) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in sse.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"])


def test_a_gateway_with_two_workers_over_these_engines_answers_every_route_as_the_deployments_own(multi, tmp_path):
    """``--workers 2`` (two gateway processes on one port, their private store and state secret): chat with
    an image, streamed chat, completions, Messages, tokenize, models, a stored response read and continued
    on new connections (either worker), and the gRPC API: each answer is the deployment's own gateway's."""
    from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from services.child import free_port
    from tools.media import data_url, make_image

    grpc_port = free_port()
    gw = ExtraGateway(multi, tmp_path, "workers", ["--workers", "2", "--grpc-port", str(grpc_port)]).start()
    try:
        gw.wait_ready()
        model = _model(multi)
        chat = image_chat(660)
        for path, body, pick in [
                ("/v1/chat/completions", chat, lambda a: a["choices"][0]["token_ids"]),
                ("/v1/completions", {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0},
                 lambda a: a["choices"][0]["text"]),
                ("/v1/messages", {"model": model, "max_tokens": 6, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Hello there."}]},
                 lambda a: [c.get("text") for c in a["content"]]),
                ("/tokenize", {"model": model, "prompt": "Hello world, again"}, lambda a: a["tokens"])]:
            status, got = gw.call("POST", path, body)
            want_status, want = post(multi.url + path, body)
            assert status == want_status == 200 and pick(got) == pick(want), (path, got, want)
        assert gw.call("GET", "/v1/models")[1]["data"][0]["id"] == model
        status, streamed = gw.call("POST", "/v1/chat/completions", {**text_chat("Tell me a story."), "stream": True})
        want = post(multi.url + "/v1/chat/completions", text_chat("Tell me a story."))[1]
        assert status == 200 and _streamed_text(streamed) == want["choices"][0]["message"]["content"], streamed

        first = {"model": model, "temperature": 0, "max_output_tokens": 6, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(make_image(661, (112, 112)))},
            {"type": "input_text", "text": "Remember this picture."}]}]}
        follow = {"model": model, "temperature": 0, "max_output_tokens": 6, "input": "What was in it?"}
        want_first, want_follow = _one_gateway_turns(multi, first, follow)
        status, made = gw.call("POST", "/v1/responses", first)
        assert status == 200 and _texts(made) == _texts(want_first), made
        for _ in range(4):  # each on a new connection: the kernel hands each to either worker
            status, read = gw.call("GET", f"/v1/responses/{made['id']}")
            assert status == 200 and _texts(read) == _texts(made), read
            status, cont = gw.call("POST", "/v1/responses", {**follow, "previous_response_id": made["id"]})
            assert status == 200 and _texts(cont) == _texts(want_follow), cont

        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            out = list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(
                gateway_pb2.OpenAIRequest(body=json.dumps(chat).encode()), timeout=120))
        assert json.loads(out[0].body)["choices"][0]["token_ids"] == post(multi.url + "/v1/chat/completions",
                                                                        chat)[1]["choices"][0]["token_ids"]
    finally:
        gw.stop()


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
