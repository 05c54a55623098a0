"""An encoder, an LM and a gateway on three hosts: the LM cannot map the
encoder's /dev/shm (another host's), so its probe fails and the embedding comes
as gRPC chunks over the network, with plain vLLM's tokens."""

from __future__ import annotations

import pytest

from tests.multihost.conftest import REQUESTS

pytestmark = pytest.mark.multihost


def test_across_hosts_the_shm_probe_fails_and_grpc_chunks_carry_the_embedding(cluster, mh_reference):
    c = cluster
    status, body, _ = c.client.post(c.url("three") + "/v1/chat/completions", REQUESTS["three"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == mh_reference["three"]
    epd = body["epd"]
    assert epd["transferred_items"] == 1 and epd["local_encoder_runs"] == 0, epd
    assert epd["transports"] == ["grpc"], epd
    assert epd["encoders"] == [c.encoder_addr(c.enc2)] and epd["lm"] == c.lm_addr(c.lm2), epd
    peer = c.transfer_addr(c.enc2)
    assert c.client.metric(c.metrics_url(c.lm2), "epd_lm_peer_transport", peer=peer, transport="grpc") == 1
    assert c.client.metric(c.metrics_url(c.lm2), "epd_lm_peer_transport", peer=peer, transport="shm") == 0
