"""services.common.layout on hand-made token lists, and the splice rule against vLLM's own prompt-update
planner on generated ones (the real processor: tests/integration/test_layout_vllm.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("prompt", [[1, 2], [IMG]])
def test_splice_refuses_a_prompt_with_fewer_placeholders_than_items(prompt):
    with pytest.raises(LayoutError, match="placeholder"):
        splice(prompt, [ItemLayout((IMG,), (5,)), ItemLayout((IMG,), (6,))])


def test_a_placeholder_past_the_last_item_stays_a_token_as_vllm_keeps_it():
    """A client's text that holds the model's image token, beside one image: the first placeholder (the
    text's, here) takes the image and the rest are ordinary tokens, as vLLM's processor leaves them."""
    assert splice([IMG, 1, IMG, IMG], [ItemLayout((IMG,), (5, 5))]) == ([5, 5, 1, IMG, IMG], [(0, 2)])


AUD = 8  # another modality's placeholder token


def test_splice_modalities_follows_the_prompt_order_across_modalities():
    """Items of each modality are in prompt order; the prompt interleaves the modalities."""
    img = [ItemLayout((IMG,), (5, 5)), ItemLayout((IMG,), (6,))]
    aud = [ItemLayout((AUD,), (9, 9, 9))]
    ids, pos = splice_modalities([1, IMG, 2, AUD, 3, IMG], {"image": img, "audio": aud})
    assert ids == [1, 5, 5, 2, 9, 9, 9, 3, 6]
    assert pos == {"image": [(1, 2), (8, 1)], "audio": [(4, 3)]}


def test_splice_modalities_counts_placeholders_per_modality():
    with pytest.raises(LayoutError, match="1 audio placeholder.*for 2 audio item"):
        splice_modalities([AUD, IMG, 3], {"image": [ItemLayout((IMG,), (5,))],
                                          "audio": [ItemLayout((AUD,), (9,)), ItemLayout((AUD,), (9,))]})
    ids, _ = splice_modalities([AUD, IMG, AUD], {"image": [ItemLayout((IMG,), (5,))], "audio": [ItemLayout((AUD,), (9,))]})
    assert ids == [9, 5, AUD]


PLACEHOLDERS = {"image": (IMG,), "audio": (AUD,), "video": (7, 6)}  # no one a prefix of another's


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.lists(st.sampled_from([1, 2, IMG, AUD, 7, 6]), max_size=14),
       counts=st.fixed_dictionaries({m: st.integers(0, 3) for m in PLACEHOLDERS}),
       width=st.integers(1, 3))
def test_splice_modalities_places_items_where_vllms_prompt_update_planner_does(prompt, counts, width):
    """vLLM's ``_apply_token_matches_with_placeholders`` (what its processor runs on a tokenized chat
    prompt) against ``splice_modalities``: the same tokens and the same item positions, and a LayoutError
    exactly where vLLM finds fewer placeholders than items (its ``_validate_mm_placeholders`` raises)."""
    processor = pytest.importorskip("vllm.multimodal.processing.processor")
    counts = {m: n for m, n in counts.items() if n}
    layouts = {m: [ItemLayout(PLACEHOLDERS[m], tuple([100 + 10 * k + j for j in range(width + k)]))
                   for k in range(n)] for m, n in counts.items()}
    updates = {m: [[processor.ResolvedPromptUpdate(
        modality=m, item_idx=k, mode=processor.UpdateMode.REPLACE, target=list(lay.placeholder),
        content=processor.PromptUpdateDetails.from_seq(list(lay.tokens)))] for k, lay in enumerate(lays)]
        for m, lays in layouts.items()}
    ids, _, found = processor._apply_token_matches_with_placeholders(list(prompt), updates)
    if any(len(found.get(m, [])) != n for m, n in counts.items()):
        with pytest.raises(LayoutError):
            splice_modalities(prompt, layouts)
        return
    ours, positions = splice_modalities(prompt, layouts)
    assert ours == ids
    assert positions == {m: [(p.start_idx, p.length) for p in found[m]] for m in counts}
