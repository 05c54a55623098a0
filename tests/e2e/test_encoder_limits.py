"""The encoder under abuse: a cancelled Encode frees the outputs it left in the
outbound pool (no consumer asked for them) at once rather than a lease later,
and a flood of pixel bombs (8 large solid-colour PNGs per request, a few KB
each) is refused while the services stay up and answer the next good request.

The encoder runs with a small token budget per engine step, so an Encode of
several images (24 here) spans several steps: its first outputs sit in the pool
while the rest still encode, which is when a client that cancels leaves them.

The same deployment's LM allows only gRPC chunks (``--transports grpc``), so it also carries
tests/e2e/test_transports.py's forced-transport case (one deployment for both; that test runs
first, on images this deployment has not seen)."""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from PIL import Image

from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from services.cli import default_model
from services.up import Deployment, grpc_serving
from tests import ahead
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, encodes_done, image_chat, metric, post, producer_stats
from tests.e2e.test_transports import forced_transport_is_exact
from tools.media import data_url, make_image

pytestmark = pytest.mark.e2e

CANCELLED_IMAGES = 48
"""Images in the Encode that is cancelled mid-encode: one per engine step, so the cancel has 47 steps to
land in (with 8, a busy 2-core host sometimes let the tiny model finish all of them first; with 24, an
engine with a core to itself did, five tries in a row)."""


def _deployment() -> Deployment:
    engine = json.dumps({"max_num_batched_tokens": 96})  # one 224x224 image (5 tiles of 16 tokens) per step
    return Deployment(model=default_model(), quiet=True, drain_grace_s=TEARDOWN_DRAIN_S,
                      encoder_args=["--vllm-args", engine, "--max-images-per-prompt", str(CANCELLED_IMAGES)],
                      lm_args=["--transports", "grpc"])


ahead.register(__name__, "dep", _deployment)


@pytest.fixture(scope="module")
def dep(tiny_model):
    d = ahead.take(__name__) or _deployment().start()
    yield d
    stop_in_background(d)


def test_a_forced_transport_is_the_one_used_and_tokens_are_exact(dep, reference):
    """gRPC chunks forced on the LM (tests/e2e/test_transports.py has the chosen-shm half)."""
    forced_transport_is_exact(dep, reference, "grpc")


def _solid_png(side: int, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _held(dep) -> float:
    s = producer_stats(dep)
    return s["items_held"] + s["pending_reservations"]


def test_a_cancelled_encode_frees_the_items_it_left_in_the_pool(dep):
    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    encodes_done(dep)  # the earlier tests' Encodes are counted (``finished`` below counts this test's alone)
    with dep.client_security.channel(dep.encoder_addr) as ch:
        stub = encoder_pb2_grpc.EncoderServiceStub(ch)
        endpoint = stub.GetInfo(encoder_pb2.GetInfoRequest(), timeout=30).transfer_endpoint
        with dep.client_security.channel(endpoint) as transfer:  # one channel: the poll must be quick
            stats = transfer_pb2_grpc.TransferServiceStub(transfer).Stats
            baseline = _cancel_mid_encode(stub, lambda: stats(transfer_pb2.StatsRequest(), timeout=30).values,
                                          lambda: metric(dep.encoder_metrics, "epd_encoder_requests_total",
                                                         status="ok"))
    t0 = time.monotonic()
    while (held := _held(dep)) > baseline and time.monotonic() - t0 < 20:  # well under the 60 s lease
        time.sleep(0.1)
    stats = producer_stats(dep)
    assert held <= baseline, (baseline, stats)  # freed by the cancel, not by the lease (60 s) expiring
    assert stats["cancels"] >= 1


def _cancel_mid_encode(stub, stats, finished) -> float:
    """Cancels an Encode of ``CANCELLED_IMAGES`` images as soon as its first output is in the pool, until one is
    cancelled while encoding (the producer counts it aborted); returns the items held before it.
    ``finished()``: the encoder's count of Encodes that ended ok (their engine request finished).
    Skips the test if every Encode finished first (5 tries)."""
    from epd.encoder.v1 import encoder_pb2

    for attempt in range(5):
        # Items of an earlier attempt whose Encode finished are rightly kept (a lease): the baseline.
        now = stats()
        baseline, aborted = now["items_held"] + now["pending_reservations"], now["aborted_requests"]
        ok = finished()
        items = [encoder_pb2.MediaItem(modality="image", data=make_image(7000 + 100 * attempt + i, (224, 224)))
                 for i in range(CANCELLED_IMAGES)]
        call = stub.Encode(encoder_pb2.EncodeRequest(request_id=f"cancelled-{attempt}", items=items), timeout=180)
        reader = threading.Thread(target=lambda call=call: list(_drain(call)), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while stats()["items_held"] <= now["items_held"]:  # its first outputs are in the pool: cancel now
            assert time.monotonic() < deadline, "no encoder output reached the pool"
            time.sleep(0.002)
        call.cancel()
        reader.join(10)
        # The engine request ended aborted (the producer counts it): cancelled while encoding, the
        # case under test. Otherwise the engine finished first (a fast machine: the Encode ended ok)
        # and its claims rightly hold the items for a consumer until the lease: try again with fresh
        # images. The abort reaches the engine and the producer within a step or two, which a
        # loaded host can stretch to seconds: waited for until the Encode is seen to have finished.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if stats()["aborted_requests"] > aborted:
                return baseline
            if finished() > ok:
                break
            time.sleep(0.1)
    pytest.skip("every Encode finished before it could be cancelled")


def _drain(call):
    try:
        yield from call
    except grpc.RpcError:
        return


def test_a_pixel_flood_is_refused_and_the_services_answer_the_next_request(dep):
    bomb = _solid_png(6000, (200, 30, 30))  # 36 M pixels in a few tens of KB
    assert len(bomb) < 1 << 20
    flood = {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(bomb)}} for _ in range(8)),
        {"type": "text", "text": "What is in these?"}]}], "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post(dep.url + "/v1/chat/completions", flood, timeout=120), range(4)))
    for status, body in results:
        assert 400 <= status < 500, (status, body)
        # The per-request pixel limit is checked from the headers, before any image is decoded.
        assert "allowed per request" in body["error"]["message"], body
    assert grpc_serving(dep.encoder_addr, timeout=30, security=dep.client_security)
    assert grpc_serving(dep.lm_addr, timeout=30, security=dep.client_security)
    status, body = post(dep.url + "/v1/chat/completions", image_chat(0))
    assert status == 200, body


def test_an_encode_over_the_request_pixel_budget_is_invalid_argument_on_the_grpc_api(dep):
    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    item = encoder_pb2.MediaItem(modality="image", data=_solid_png(6000, (10, 10, 200)))
    with dep.client_security.channel(dep.encoder_addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(encoder_pb2_grpc.EncoderServiceStub(ch).Encode(
                encoder_pb2.EncodeRequest(request_id="flood", items=[item] * 8), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "per request" in e.value.details()
