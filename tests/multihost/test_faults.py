"""Faults between hosts, on the shared deployment, last (they hurt it): a slow
link, a link cut while a transfer crosses it, and an encoder host whose
processes all die. The victim is always ``enc2`` and the requests are images
the gateway's routing sends there. Each fault ends in failover to ``enc1``
with plain vLLM's tokens, within the bound each test states, and afterwards
no reservation or unacked item stays held on any side that is up (the
encoders' Transfer ``Stats`` RPC, the LMs' consumer gauges)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.multihost.cluster import ENCODE_TIMEOUT_S, LEASE_S, TRANSFER_PORT, TRANSFER_TIMEOUT_S
from tests.multihost.conftest import REQUESTS
from tests.multihost.hosts import netem_unavailable

pytestmark = pytest.mark.multihost

# A request caught by a fault waits at most for the gateway's Encode timeout or the
# LM's transfer timeout, then is retried once elsewhere; 20 s covers that retry on a
# loaded 2-core host.
FAILOVER_BOUND_S = max(ENCODE_TIMEOUT_S, TRANSFER_TIMEOUT_S) + 20
# Unacked outputs of a failed transfer are freed by their lease at the latest.
RELEASE_BOUND_S = LEASE_S + 15
# Re-admission after the link cut waits on TCP retransmit backoff of the gateway's channels.
ADMIT_S = 60.0

_used: set[str] = set()


def _victim_images(c, n: int) -> list[str]:
    """``n`` fresh images whose affine encoder is enc2 (while both are admitted)."""
    names = [k for k in REQUESTS if k.startswith("fault") and k not in _used
             and c.affine(REQUESTS[k], [c.enc1, c.enc2]) is c.enc2][:n]
    assert len(names) == n, "not enough fault images map to enc2"
    _used.update(names)
    return names


def _gateway_metric(c, name: str, **labels: str) -> float:
    return c.client.metric(c.url("dns") + "/metrics", name, **labels)


def _wait_in_flight_at(c, host, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _gateway_metric(c, "epd_gateway_instance_outstanding", role="encoder",
                          instance=c.encoder_addr(host)) < 1:
        assert time.monotonic() < deadline, f"no request ever in flight at {host.name}"
        time.sleep(0.1)


def _check_exact(mh_reference, results: dict) -> None:
    for name, (status, body, _) in results.items():
        assert status == 200, (name, body)
        assert body["choices"][0]["token_ids"] == mh_reference[name], name


SLOW_LINKS = {
    # What the issue asks for; needs the kernel's sch_netem.
    "netem-delay-50ms-loss-1pct": ("netem", "delay", "50ms", "loss", "1%"),
    # A thin link (8 KB/s), which every kernel with tbf can make: a 4 KiB item takes ~0.5 s.
    "tbf-64kbit": ("tbf", "rate", "64kbit", "burst", "4kb", "latency", "5s"),
}


@pytest.mark.parametrize("link", list(SLOW_LINKS))
def test_a_slow_link_to_an_encoder_costs_time_not_tokens(cluster, mh_reference, link):
    c = cluster
    if link.startswith("netem") and (why := netem_unavailable()):
        pytest.skip(why)
    c.wait_admitted("dns", [c.enc1, c.enc2], [c.lm1, c.lm2], ADMIT_S)
    names = _victim_images(c, 2)
    url = c.url("dns") + "/v1/chat/completions"
    c.enc2.set_qdisc(*SLOW_LINKS[link])
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(names)) as pool:
            results = dict(zip(names, pool.map(lambda n: c.client.post(url, REQUESTS[n]), names)))
        elapsed = time.monotonic() - t0
    finally:
        c.enc2.set_qdisc()
    _check_exact(mh_reference, results)
    assert elapsed < FAILOVER_BOUND_S, elapsed  # served over the slow link, or failed over in bound
    assert any(body["epd"]["encoders"] == [c.encoder_addr(c.enc2)] for _, body, _ in results.values()), \
        "none was served over the slow link"
    c.wait_no_reservations(RELEASE_BOUND_S)


def test_a_link_cut_during_a_transfer_fails_over_to_the_other_encoder(cluster, mh_reference):
    c = cluster
    c.wait_admitted("dns", [c.enc1, c.enc2], [c.lm1, c.lm2], ADMIT_S)
    names = _victim_images(c, 3)
    url = c.url("dns") + "/v1/chat/completions"
    retries = _gateway_metric(c, "epd_gateway_retries_total")
    lm_errors = sum(c.client.metric(c.metrics_url(h), "epd_lm_requests_total", status="error") for h in c.lm_hosts)
    try:
        # What enc2 sends from its Transfer port is dropped (its API answers at full speed, so the
        # encodes finish and the LMs are sent Generate): no item crosses, so each LM's pull is still
        # waiting whenever the cut below lands, and fails (at the latest at its transfer timeout).
        c.enc2.black_hole_port(TRANSFER_PORT)
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {n: pool.submit(c.client.post, url, REQUESTS[n]) for n in names}
            # Cut once an LM has a request and no Encode is in flight at enc2 (a cut during an encode
            # would be an encode timeout, not a transfer failure).
            deadline = time.monotonic() + 30
            while (sum(_gateway_metric(c, "epd_gateway_instance_outstanding", role="lm", instance=c.lm_addr(h))
                       for h in c.lm_hosts) < 1
                   or _gateway_metric(c, "epd_gateway_instance_outstanding", role="encoder",
                                      instance=c.encoder_addr(c.enc2)) > 0):
                assert time.monotonic() < deadline, "no LM ever got the requests with their encodes done"
                time.sleep(0.05)
            c.enc2.set_link(False)
            t0 = time.monotonic()
            results = {n: f.result(timeout=FAILOVER_BOUND_S + 60) for n, f in futures.items()}
            elapsed = time.monotonic() - t0
    finally:
        c.enc2.set_link(True)
        c.enc2.set_qdisc()
    _check_exact(mh_reference, results)
    assert elapsed < FAILOVER_BOUND_S, elapsed
    assert _gateway_metric(c, "epd_gateway_retries_total") > retries, "requests caught by the cut were retried"
    # An LM's attempt failed (not a gateway-side encode timeout, which would cancel it): the cut
    # hit a transfer.
    assert sum(c.client.metric(c.metrics_url(h), "epd_lm_requests_total", status="error")
               for h in c.lm_hosts) > lm_errors
    assert any(body["epd"]["encoders"] == [c.encoder_addr(c.enc1)] for _, body, _ in results.values()), results
    # The link is back: enc2 is re-admitted, and neither side keeps anything of the cut transfers.
    c.wait_admitted("dns", [c.enc1, c.enc2], [c.lm1, c.lm2], ADMIT_S)
    c.wait_no_reservations(RELEASE_BOUND_S)


def test_an_encoder_host_whose_processes_all_die_fails_over_to_the_other_encoder(cluster, mh_reference):
    c = cluster
    c.wait_admitted("dns", [c.enc1, c.enc2], [c.lm1, c.lm2], ADMIT_S)
    names = _victim_images(c, 3)
    url = c.url("dns") + "/v1/chat/completions"
    retries = _gateway_metric(c, "epd_gateway_retries_total")
    # Its engine processes frozen first, so its encodes are surely in flight when the host dies. Not
    # the service itself: it still answers health checks, so enc2 stays admitted until it dies.
    service = c.services["enc2"].proc.pid
    frozen = [pid for pid in c.enc2.pids() if pid != service]
    assert frozen, "enc2 has no engine process"
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(c.client.post, url, REQUESTS[n]) for n in names}
        _wait_in_flight_at(c, c.enc2)
        c.enc2.kill_all()
        t0 = time.monotonic()
        results = {n: f.result(timeout=FAILOVER_BOUND_S + 60) for n, f in futures.items()}
        elapsed = time.monotonic() - t0
    _check_exact(mh_reference, results)
    assert elapsed < FAILOVER_BOUND_S, elapsed
    for name, (_, body, _) in results.items():
        assert body["epd"]["encoders"] == [c.encoder_addr(c.enc1)], (name, body["epd"])
    assert _gateway_metric(c, "epd_gateway_retries_total") > retries
    deadline = time.monotonic() + 30  # a failed call or the next 2 s health round; each poll is a process
    while c.health("dns")["encoders"].get(c.encoder_addr(c.enc2)):
        assert time.monotonic() < deadline, "the dead encoder host was never ejected"
        time.sleep(0.3)
    assert not c.services["enc2"].alive()
    c.wait_no_reservations(RELEASE_BOUND_S)
