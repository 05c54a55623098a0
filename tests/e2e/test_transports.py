"""The foundation's exactness holds with each CPU transport: the same host chooses shared memory on
its own (the session deployment), and gRPC chunks forced (``forced_transport_is_exact``, run on the
deployment of tests/e2e/test_encoder_limits.py, whose LM allows only grpc: one deployment for both).
Forcing shm (``--transports shm``) takes the same data path as choosing it; what differs, refusing
a failed probe instead of falling back, is tested without engines (tests/integration)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import metric, post

pytestmark = pytest.mark.e2e


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


def forced_transport_is_exact(dep, reference, name: str) -> None:
    """``dep``'s LM allows only transport ``name``: it is the one used, and tokens are exact."""
    _exact(dep, reference, ["image0", "image2"])
    assert metric(dep.lm_metrics, "epd_lm_peer_transport", transport=name) == 1
    other = {"grpc": "shm", "shm": "grpc"}[name]
    assert metric(dep.lm_metrics, "epd_lm_peer_transport", transport=other) == 0
