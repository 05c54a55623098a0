"""A burst of image chats, distinct and repeated images, 16 at a time, with pools sized for about four
items on each side: every request completes with plain vLLM's tokens, nothing is dropped, and at the end
every pool reports 0 reserved bytes and 0 pending reservations. The default run sends 32 requests (two
waves of the concurrency, every pool oversubscribed four times from the first wave on); the slow tier
sends the 200 of the reliability goal (docs/design.md)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.up import Deployment
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, metric, post, producer_stats, settled
from tests.references import BURST, BURST_DISTINCT, REFERENCE_REQUESTS

pytestmark = pytest.mark.e2e

ITEM_MIB = 16 * 128 * 2 / (1 << 20)  # one tiny-model image: 16 rows x 128 bf16
POOL_MIB = str(4.5 * ITEM_MIB)       # about four items (plus the shm probe slot)


@pytest.mark.parametrize("n", [32, pytest.param(200, marks=pytest.mark.slow)])
def test_a_burst_with_pools_for_4_items_completes_exactly_and_drains(tiny_model, reference_run, n):
    names = [f"burst{i % BURST_DISTINCT}" for i in range(n)]
    bodies = [BURST[name] for name in names]
    dep = Deployment(model=tiny_model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, encoder_args=["--outbound-pool-mib", POOL_MIB],
                     lm_args=["--staging-mib", POOL_MIB])
    dep.start()
    try:  # plain vLLM's answers (the session's run, tests/references.py), computed while it started
        reference = dict(zip(REFERENCE_REQUESTS, reference_run.result()))
    except BaseException:
        dep.stop()
        raise

    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda b: post(dep.url + "/v1/chat/completions", b, 120), bodies))
        failures = [(s, r) for s, r in results if s != 200]
        assert not failures, failures[:3]
        for name, (_, resp) in zip(names, results):
            assert resp["choices"][0]["token_ids"] == reference[name], name

        deadline = time.monotonic() + 60
        while (stats := producer_stats(dep))["items_held"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the last acks travel after the last engine step
        assert stats["reserved_bytes"] == 0 and stats["pending_reservations"] == 0, stats
        assert stats["items_held"] == 0 and stats["expired"] == 0, stats
        # The LM's gauges are its engine's last step's snapshot: they can trail the producer's Stats.
        assert settled(lambda: metric(dep.lm_metrics, "epd_ec_reserved_bytes", role="consumer"), 0) == 0
        assert settled(lambda: metric(dep.lm_metrics, "epd_ec_pending_reservations", role="consumer"), 0) == 0
        assert metric(dep.lm_metrics, "epd_ec_pool_capacity_bytes", role="consumer") > 0  # the gauges exist
    finally:
        stop_in_background(dep)
