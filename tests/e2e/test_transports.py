"""Issue 3 must-show: the foundation's exactness holds with each CPU transport
forced, and the same host chooses shared memory on its own."""

from __future__ import annotations

import pytest

from services.up import Deployment
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import metric, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def chunks_only(tiny_model):
    with Deployment(model=tiny_model, quiet=True, lm_args=["--transports", "grpc"]) as dep:
        yield dep


def _exact(dep, reference, names) -> None:
    # Images this deployment has not seen yet: a seen one may be served from
    # the LM's encoder cache without any transfer (reuse).
    for name in names:
        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS[name])
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference[name], name
        assert body["epd"]["transferred_items"] == 1 and body["epd"]["local_encoder_runs"] == 0


def test_same_host_chooses_shm_and_tokens_are_exact(deployment, reference):
    _exact(deployment, reference, ["fresh_shm"])
    assert metric(deployment.lm_metrics, "epd_lm_peer_transport", transport="shm") == 1
    assert metric(deployment.lm_metrics, "epd_lm_peer_transport", transport="grpc") == 0


def test_chunks_forced_tokens_are_exact(chunks_only, reference):
    _exact(chunks_only, reference, ["image0", "image2"])
    assert metric(chunks_only.lm_metrics, "epd_lm_peer_transport", transport="grpc") == 1
    assert metric(chunks_only.lm_metrics, "epd_lm_peer_transport", transport="shm") == 0
