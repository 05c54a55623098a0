"""Two encoders and two LMs on four hosts behind one gateway that knows them by
one name per role (``encoders.epd``, ``lms.epd``), resolved through its host's
/etc/hosts to both addresses, as a Kubernetes headless Service is. The names'
addresses change while requests run; with ``--dns-refresh-s 1`` the gateway
follows within seconds, and no request fails or returns other tokens."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.multihost.conftest import REQUESTS

pytestmark = pytest.mark.multihost

FOLLOW_S = 20.0  # names re-resolved on the 2 s health tick: generous for a loaded 2-core host


def _exact(c, mh_reference, name: str, result) -> dict:
    status, body, _ = result
    assert status == 200, (name, body)
    assert body["choices"][0]["token_ids"] == mh_reference[name], name
    return body["epd"]


def test_one_name_per_role_finds_every_host_and_follows_its_addresses_while_traffic_runs(cluster, mh_reference):
    c = cluster
    both_enc, both_lm = [c.enc1, c.enc2], [c.lm1, c.lm2]
    c.wait_admitted("dns", both_enc, both_lm, FOLLOW_S)
    url = c.url("dns") + "/v1/chat/completions"

    # Both names resolve to both hosts: each image goes to its affine encoder, both LMs serve.
    used_lms = set()
    for name in ("dns0", "dns1", "dns2", "dns3"):
        c.wait_admitted("dns", both_enc, both_lm, FOLLOW_S)
        epd = _exact(c, mh_reference, name, c.client.post(url, REQUESTS[name]))
        assert epd["encoders"] == [c.encoder_addr(c.affine(REQUESTS[name], both_enc))], (name, epd)
        assert epd["transports"] == [("shm" if epd["encoders"] == [c.encoder_addr(c.enc1)]
                                      and epd["lm"] == c.lm_addr(c.lm1) else "grpc")], epd
        used_lms.add(epd["lm"])
    # A tie between idle LMs goes by the request's key (rendezvous hashing): if the four images' did not
    # reach both LMs, a few different text requests do.
    for n in range(32):
        if len(used_lms) == len(both_lm):
            break
        status, body, _ = c.client.post(url, {"messages": [{"role": "user", "content": f"Say {n}."}], "max_tokens": 1})
        assert status == 200, body
        used_lms.add(body["epd"]["lm"])
    assert used_lms == {c.lm_addr(h) for h in both_lm}, used_lms

    # Traffic runs while the names change to one host each.
    stop = threading.Event()
    results: list[tuple[str, tuple]] = []

    def traffic(names: list[str]) -> None:
        for name in names:
            if stop.is_set():
                return
            results.append((name, c.client.post(url, REQUESTS[name])))

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(traffic, ["dns4", "dns5", "dns6"]), pool.submit(traffic, ["dns7", "dns8", "dns9"])]
        time.sleep(1.0)
        c.set_names([c.enc1], [c.lm2])
        t0 = time.monotonic()
        health = c.wait_admitted("dns", [c.enc1], [c.lm2], FOLLOW_S)
        followed_s = time.monotonic() - t0
        for r in runs:
            r.result(timeout=300)
    assert len(results) == 6
    for name, result in results:
        _exact(c, mh_reference, name, result)
    assert set(health["encoders"]) == {c.encoder_addr(c.enc1)}, (followed_s, health)

    # Only the hosts left in the names serve, whatever the image's affinity was.
    name = next(n for n in ("dns10", "dns11", "dns12", "dns13", "dns14", "dns15") if c.affine(REQUESTS[n], both_enc) is c.enc2)
    epd = _exact(c, mh_reference, name, c.client.post(url, REQUESTS[name]))
    assert epd["encoders"] == [c.encoder_addr(c.enc1)] and epd["lm"] == c.lm_addr(c.lm2), epd

    # Back to both: both are admitted again.
    c.set_names(both_enc, both_lm)
    c.wait_admitted("dns", both_enc, both_lm, FOLLOW_S)
