"""Issue 34: the LM computes a prompt in step with its items' arrival, on the session deployment. The
encoder's test hook (tests/e2e/perturb/sitecustomize.py) reports the second of three images (encoded in
one engine step) seconds late: the LM computes the prompt past the first image before the second lands
(``epd_ec_prefill_ahead_tokens``), nothing is encoded on the LM, and the tokens are plain vLLM's. A client
that gives up while the late item is in flight leaves nothing held. (The connector-level orderings, a late
item's failure included: tests/integration/test_prefill_in_step.py. Audio and video with a late item:
tests/e2e/test_families.py, ``test_audio_and_video_are_computed_in_step_with_a_late_item``.)"""

from __future__ import annotations

import socket
import time

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import LATE_S, encodes_done, late_items, metric, post, producer_stats, settled

pytestmark = pytest.mark.e2e

FIRST_ITEM_TOKENS = 16  # the first image's placeholder holds at least its 16 embeddings


def _ahead(dep) -> float:
    return metric(dep.lm_metrics, "epd_ec_prefill_ahead_tokens", role="consumer")


def test_the_lm_computes_past_the_first_item_while_the_second_is_late(deployment, reference):
    dep = deployment
    encodes_done(dep)
    ahead0 = _ahead(dep)
    local0 = metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total")
    with late_items(dep):
        t0 = time.monotonic()
        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["late_item"])
        elapsed = time.monotonic() - t0
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["late_item"]
    assert elapsed >= LATE_S, elapsed  # the second image was late
    # Computed while the second image was in flight: the text before the first image, the first image's
    # placeholder and the text up to the second's. Without prefill in step it would be 0; stopped at the
    # first image (had it been late too), fewer than the first image's own tokens.
    ahead = settled(lambda: _ahead(dep) - ahead0, -1, timeout=5)
    assert ahead > FIRST_ITEM_TOKENS, ahead
    assert metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total") == local0  # every image from the encoder


def test_a_request_with_its_own_seed_and_a_late_item_is_answered_exactly_and_the_engine_lives(deployment, reference):
    """vLLM 0.32's CPU worker cannot compute part of a seeded request's prompt (the engine died on it:
    ``ConsumerScheduler._may_compute_part_of``): such a request waits for all its items."""
    dep = deployment
    encodes_done(dep)
    ahead0 = _ahead(dep)
    with late_items(dep):
        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["late_seeded"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["late_seeded"]
    assert settled(lambda: _ahead(dep) - ahead0, 0, timeout=2) == 0
    status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200 and body["choices"][0]["token_ids"] == reference["image0"], body


def test_a_client_that_gives_up_while_an_item_is_late_leaves_nothing_held(deployment, reference):
    dep = deployment
    encodes_done(dep)
    with late_items(dep, seconds=LATE_S + 2):
        with pytest.raises((TimeoutError, socket.timeout, OSError)):
            post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["late_cancelled"], timeout=LATE_S / 2)
        time.sleep(LATE_S + 2.5)  # the late report arrives after the cancel
    deadline = time.monotonic() + 60
    while (stats := producer_stats(dep))["items_held"] or stats["pending_reservations"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert settled(lambda: metric(dep.lm_metrics, "epd_ec_reserved_bytes", role="consumer"), 0) == 0
    assert settled(lambda: metric(dep.lm_metrics, "epd_ec_pending_reservations", role="consumer"), 0) == 0
    status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200 and body["choices"][0]["token_ids"] == reference["image0"], body
