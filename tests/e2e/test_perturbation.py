"""Issue 12: the LM really generates from the transferred embedding. A test-only hook
(``tests/e2e/perturb/sitecustomize.py``, put on the services' PYTHONPATH here and nowhere else)
negates and scales each embedding as the LM's worker injects it: the requests still succeed,
every image went through the hook, and the greedy tokens are no longer plain vLLM's. The
unperturbed path giving exactly plain vLLM's tokens is every other e2e test. One family of each
kind: the tiny Idefics3 (laid out from the encoder's layout alone) and Qwen2.5-VL (metadata-only
items: each image's grid travels beside its embedding, M-RoPE positions come from it)."""

from __future__ import annotations

import os

import pytest

from services.common.images import data_url, make_image
from services.reference import run_subprocess
from services.up import Deployment
from tests.e2e.helpers import metric, post

pytestmark = pytest.mark.e2e

HOOK_DIR = os.path.join(os.path.dirname(__file__), "perturb")


def _chat(seed: int) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (224, 224)))}},
        {"type": "text", "text": "Describe the picture."}]}],
        "max_tokens": 12, "temperature": 0, "return_token_ids": True}


@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl"])
def test_an_embedding_changed_in_transit_changes_the_tokens(family, tiny_model, tmp_path, monkeypatch):
    from services.cli import default_model

    model = tiny_model if family == "idefics3" else default_model(family=family)
    bodies = [_chat(9100 + i) for i in range(3)]
    reference = run_subprocess(model, bodies)
    log = tmp_path / "perturbed.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (HOOK_DIR, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("EPD_TEST_PERTURB_EMBEDDINGS", "1")
    monkeypatch.setenv("EPD_TEST_PERTURB_LOG", str(log))
    with Deployment(model=model, quiet=True) as dep:
        lm_runs = metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total")
        results = [post(dep.url + "/v1/chat/completions", b, 120) for b in bodies]
        assert all(status == 200 for status, _ in results), results
        assert metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total") == lm_runs  # every image transferred
    perturbed = log.read_text().split()
    assert len(set(perturbed)) == len(bodies), perturbed  # each image's embedding went through the hook
    got = [body["choices"][0]["token_ids"] for _, body in results]
    assert all(g != r for g, r in zip(got, reference)), (got, reference)
