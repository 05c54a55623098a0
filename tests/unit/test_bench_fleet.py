"""bench/fleet.py: the multi-turn workload it sends and the rows it computes (no engines: the run itself is
by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import collections

import pytest

from tests.unit.helpers import load_bench

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def fleet():
    return load_bench("fleet")


def test_conversations_are_4_to_8_turns_about_zipf_popular_images_and_repeatable(fleet):
    convs = fleet.conversations(400, 8, 1.1, seed=3)
    assert convs == fleet.conversations(400, 8, 1.1, seed=3)
    assert all(4 <= turns <= 8 for _, turns in convs)
    counts = collections.Counter(image for image, _ in convs)
    assert set(counts) <= set(range(8)) and counts[0] > counts[7] * 2  # the popular image is shared most


def test_a_text_share_of_conversations_have_no_image_and_a_text_of_their_own(fleet):
    convs = fleet.conversations(400, 8, 1.1, seed=3, text_share=0.5)
    assert 150 < sum(image < 0 for image, _ in convs) < 250
    first = [fleet.first_message(-1, i)["content"] for i in range(2)]
    assert first[0] != first[1] and len(first[0].split()) > fleet.BLOCK // 2


def test_the_first_turn_fills_a_kv_block_so_the_next_one_can_hit_it(fleet):
    # A whole block of the first turn is what a later turn can find; with the image that needs text too.
    assert len(fleet.QUESTION.split()) > fleet.BLOCK // 2
    msg = fleet.first_message(0)
    assert msg["content"][0]["type"] == "image_url" and msg["content"][1]["text"] == fleet.QUESTION


def test_metric_totals_sum_the_label_sets_asked_for(fleet):
    samples = {'a_total{decision="held"}': 2.0, 'a_total{decision="load"}': 3.0, "b_total": 1.0}
    assert fleet.total(samples, "a_total") == 5.0
    assert fleet.total(samples, "a_total", 'decision="held"') == 2.0
    assert fleet.total(samples, "b_total") == 1.0
