"""bench/lm_cpu.py reads vLLM's counters from a Prometheus page, each summed over its label sets."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def test_the_counters_are_summed_over_their_labels_and_others_ignored():
    pytest.importorskip("psutil")
    from lm_cpu import parse_counters

    page = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 5.0
vllm:num_preemptions_total{engine="0"} 0.0
vllm:iteration_tokens_total_count{engine="0"} 12.0
vllm:iteration_tokens_total_sum{engine="0"} 99.0
epd_lm_requests_total{status="ok"} 3.0
"""
    assert parse_counters(page) == {"prompt_tokens_total": 105.0, "num_preemptions_total": 0.0,
                                    "iteration_tokens_total_count": 12.0}
