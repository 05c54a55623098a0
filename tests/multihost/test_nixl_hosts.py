"""An encoder and an LM on two hosts over NIXL: the LM (``--transports nixl``, UCX held to TCP)
READs the embedding out of the encoder's registered pool across the bridge, with plain vLLM's
tokens, and the answer's facts name the transport. Runs last: it restarts lm2 for good."""

from __future__ import annotations

import time

import pytest

from tests.multihost.conftest import REQUESTS

# An LM restarted (and enc2, which the faults before it killed): a minute or more on 2 cores, so in the slow
# tier (make test-all); tests/integration/test_nixl_transport.py covers the transport in the default run.
pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_across_hosts_nixl_reads_the_embedding_exact_and_the_facts_name_it(cluster, mh_reference):
    c = cluster
    if not c.services["enc2"].alive():  # the faults' last test kills it; started again beside lm2
        c.restart("enc2")
    c.use_nixl(c.lm2)
    c.wait_admitted("three", [c.enc2], [c.lm2], timeout=120)
    status, body, _ = c.client.post(c.url("three") + "/v1/chat/completions", REQUESTS["three"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == mh_reference["three"]
    epd = body["epd"]
    assert epd["transferred_items"] == 1 and epd["local_encoder_runs"] == 0, epd
    assert epd["transports"] == ["nixl"], epd
    assert epd["encoders"] == [c.encoder_addr(c.enc2)] and epd["lm"] == c.lm_addr(c.lm2), epd
    peer = c.transfer_addr(c.enc2)
    assert c.client.metric(c.metrics_url(c.lm2), "epd_lm_peer_transport", peer=peer, transport="nixl") == 1
    # The READ's copy acked and freed, nothing held on either side of this pair.
    deadline = time.monotonic() + 60
    while True:
        enc = c.client.stats(c.encoder_addr(c.enc2))
        held = {"enc2": {k: enc.get(k, -1) for k in ("pending_reservations", "reserved_bytes", "items_held")},
                "lm2": {k: c.client.metric(c.metrics_url(c.lm2), f"epd_ec_{k}", required=True, role="consumer")
                        for k in ("pending_reservations", "reserved_bytes")}}
        if all(v == 0 for side in held.values() for v in side.values()):
            break
        assert time.monotonic() < deadline, f"still held after 60s: {held}"
        time.sleep(1.0)
