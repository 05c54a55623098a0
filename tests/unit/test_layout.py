"""services.common.layout on hand-made token lists (the real processor: tests/integration/test_layout_vllm.py)."""

from __future__ import annotations

import pytest

from services.common.layout import ItemLayout, LayoutError, item_layouts, splice, splice_modalities

IMG = 9  # the placeholder token


def test_layouts_of_a_replacing_processor_with_a_bos_and_markers_around_each_placeholder():
    # original: BOS [S IMG E] [S IMG E]; the processor replaces IMG only (Qwen2-VL style)
    original = [1, 7, IMG, 8, 7, IMG, 8]
    processed = [1, 7, 5, 5, 5, 8, 7, 6, 6, 8]
    layouts = item_layouts(original, processed, [(2, 3, b""), (7, 2, b"\x01\x00")])
    assert layouts == [ItemLayout((IMG,), (5, 5, 5), b""), ItemLayout((IMG,), (6, 6), b"\x01\x00")]
    assert [lay.num_embeds for lay in layouts] == [3, 1]


def test_layouts_are_refused_when_the_processor_does_more_than_replace():
    original = [IMG, IMG]
    assert item_layouts(original, [5, 5, 3, 6], [(0, 2, b""), (3, 1, b"")]) is None  # a token inserted between
    assert item_layouts(original, [5, 6, 6], [(0, 1, b""), (1, 1, b"")]) is None  # a token appended
    assert item_layouts([IMG], [4, 5], [(0, 2, b"")]) == [ItemLayout((IMG,), (4, 5))]
    assert item_layouts([], [], []) == []


def test_splice_replaces_placeholders_left_to_right_and_reports_positions():
    a, b = ItemLayout((IMG,), (5, 5, 5)), ItemLayout((IMG,), (6,))
    ids, pos = splice([1, 2, IMG, 3, IMG], [a, b])
    assert ids == [1, 2, 5, 5, 5, 3, 6] and pos == [(2, 3), (6, 1)]
    multi = ItemLayout((7, IMG), (7, 4, 4))
    assert splice([IMG, 7, IMG, 7], [multi]) == ([IMG, 7, 4, 4, 7], [(1, 3)])


@pytest.mark.parametrize("prompt", [[1, 2], [IMG], [IMG, IMG, IMG]])
def test_splice_refuses_a_prompt_whose_placeholders_do_not_match_the_items(prompt):
    with pytest.raises(LayoutError, match="placeholder"):
        splice(prompt, [ItemLayout((IMG,), (5,)), ItemLayout((IMG,), (6,))])


AUD = 8  # another modality's placeholder token


def test_splice_modalities_follows_the_prompt_order_across_modalities():
    """Items of each modality are in prompt order; the prompt interleaves the modalities."""
    img = [ItemLayout((IMG,), (5, 5)), ItemLayout((IMG,), (6,))]
    aud = [ItemLayout((AUD,), (9, 9, 9))]
    ids, pos = splice_modalities([1, IMG, 2, AUD, 3, IMG], {"image": img, "audio": aud})
    assert ids == [1, 5, 5, 2, 9, 9, 9, 3, 6]
    assert pos == {"image": [(1, 2), (8, 1)], "audio": [(4, 3)]}


def test_splice_modalities_counts_placeholders_per_modality():
    with pytest.raises(LayoutError, match="2 audio placeholder.*for 1 audio item"):
        splice_modalities([AUD, IMG, AUD], {"image": [ItemLayout((IMG,), (5,))], "audio": [ItemLayout((AUD,), (9,))]})
