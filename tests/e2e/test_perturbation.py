"""The LM really generates from the transferred embedding. A test-only hook
(``tests/e2e/perturb/sitecustomize.py``, loaded in the session deployment's services and the family
deployments, off until a test turns it on) negates and scales each embedding as the LM's worker
injects it: the requests still succeed, every image went through the hook, and the greedy tokens are
no longer plain vLLM's. The unperturbed path giving exactly plain vLLM's tokens is every other e2e
test. One family of each kind: the tiny Idefics3 here (laid out from the encoder's layout alone), and
Qwen2.5-VL (metadata-only items: each image's grid travels beside its embedding) in
tests/e2e/test_families.py, on that family's deployment."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import check_perturbation_changes_tokens

pytestmark = pytest.mark.e2e


def test_an_embedding_changed_in_transit_changes_the_tokens(deployment, reference):
    names = [f"perturb{i}" for i in range(3)]
    check_perturbation_changes_tokens(deployment, [REFERENCE_REQUESTS[n] for n in names],
                                      [reference[n] for n in names])
