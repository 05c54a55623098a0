"""A gateway with no encoder serves media colocated: the LM's vLLM encodes the
image itself, as plain vLLM does (the serving benchmark's baseline system)."""

from __future__ import annotations

import pytest

from services.up import Deployment
from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import post

pytestmark = pytest.mark.e2e


def test_colocated_mode_encodes_on_the_lm_with_exact_tokens(tiny_model, reference):
    with Deployment(model=tiny_model, quiet=True, with_encoder=False) as dep:
        status, body = post(dep.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["image0"]
    assert body["epd"]["local_encoder_runs"] == 1 and body["epd"]["transferred_items"] == 0
