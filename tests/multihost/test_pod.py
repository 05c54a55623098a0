"""An encoder and an LM in one pod: two hosts with their own networks that
share one /dev/shm volume. The LM's probe maps the encoder's segment, so shared
memory is chosen (the control lane, an abstract unix socket of the encoder's
network namespace, is out of reach: control messages stay on the gRPC stream)."""

from __future__ import annotations

import pytest

from tests.multihost.conftest import REQUESTS

pytestmark = pytest.mark.multihost


def test_an_encoder_and_an_lm_sharing_dev_shm_across_networks_choose_shm(cluster, mh_reference):
    c = cluster
    status, body, _ = c.client.post(c.url("pod") + "/v1/chat/completions", REQUESTS["pod"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == mh_reference["pod"]
    epd = body["epd"]
    assert epd["transferred_items"] == 1 and epd["local_encoder_runs"] == 0, epd
    assert epd["transports"] == ["shm"], epd
    assert epd["encoders"] == [c.encoder_addr(c.enc1)] and epd["lm"] == c.lm_addr(c.lm1), epd
    peer = c.transfer_addr(c.enc1)
    assert c.client.metric(c.metrics_url(c.lm1), "epd_lm_peer_transport", peer=peer, transport="shm") == 1
    assert c.client.metric(c.metrics_url(c.lm1), "epd_lm_peer_transport", peer=peer, transport="grpc") == 0
