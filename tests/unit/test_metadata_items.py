"""Issue 12: items of families that need processed metadata without the media (Qwen-VL's
image grid for M-RoPE). The LM lays the prompt out with the encoder's metadata-only item;
an item without it is refused as bad input before it reaches the engine (which would fail
the whole batch on it)."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import BadInput
from services.common.layout import ItemLayout
from services.lm.frontend import RequestContext, _lay_out

pytestmark = pytest.mark.unit

PH = 7  # the placeholder token


def _prompt(n: int) -> dict:
    return {"prompt_token_ids": [1, *([PH] * n), 2], "multi_modal_data": {"image": [None] * n},
            "multi_modal_uuids": {"image": [f"img-{i}" for i in range(n)]}}


def _ctx(with_kwargs: bool) -> RequestContext:
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem, MultiModalSharedField

    ctx = RequestContext()
    for i in range(2):
        ctx.layouts[f"img-{i}"] = ItemLayout((PH,), (5, 9, 9, 9, 9, 6), bytes([0, 1, 1, 1, 1, 0]))
        if with_kwargs:
            elem = MultiModalFieldElem(data=torch.tensor([1, 4, 4]), field=MultiModalSharedField(batch_size=1))
            ctx.mm_kwargs[f"img-{i}"] = MultiModalKwargsItem({"image_grid_thw": elem})
    return ctx


def test_metadata_only_items_travel_into_the_engine_input():
    out = _lay_out(_prompt(2), _ctx(True), {"image": {"image_grid_thw"}})
    items = out["mm_kwargs"]["image"]
    assert [it["image_grid_thw"].data.tolist() for it in items] == [[1, 4, 4], [1, 4, 4]]
    assert out["prompt_token_ids"] == [1, 5, 9, 9, 9, 9, 6, 5, 9, 9, 9, 9, 6, 2]


def test_an_item_without_the_metadata_its_family_needs_is_refused():
    with pytest.raises(BadInput, match="image_grid_thw"):
        _lay_out(_prompt(2), _ctx(False), {"image": {"image_grid_thw"}})


def test_families_that_need_none_lay_out_without_it():
    out = _lay_out(_prompt(1), _ctx(False), {})
    assert out["mm_kwargs"]["image"] == [None]


def test_audio_and_image_items_lay_out_together_each_with_its_own_metadata():
    """Qwen2-Audio's clips bring audio_num_tokens; a prompt may interleave modalities (vLLM lists
    each modality's items in prompt order)."""
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    aud = 8
    ctx = _ctx(True)
    ctx.layouts["clip-0"] = ItemLayout((aud,), (aud, aud, aud))
    ctx.mm_kwargs["clip-0"] = MultiModalKwargsItem({"audio_num_tokens": MultiModalFieldElem(
        data=torch.tensor(3), field=MultiModalBatchedField(keep_on_cpu=True))})
    prompt = {"prompt_token_ids": [1, aud, PH, 2], "multi_modal_data": {"image": [None], "audio": [None]},
              "multi_modal_uuids": {"image": ["img-0"], "audio": ["clip-0"]}}
    out = _lay_out(prompt, ctx, {"image": {"image_grid_thw"}, "audio": {"audio_num_tokens"}})
    assert out["prompt_token_ids"] == [1, aud, aud, aud, 5, 9, 9, 9, 9, 6, 2]
    assert [(r.offset, r.length) for r in out["mm_placeholders"]["audio"]] == [(1, 3)]
    assert [(r.offset, r.length) for r in out["mm_placeholders"]["image"]] == [(4, 6)]
    assert out["mm_kwargs"]["audio"][0]["audio_num_tokens"].data.item() == 3
    del ctx.mm_kwargs["clip-0"]
    with pytest.raises(BadInput, match=r"audio 'clip-0'... came without \['audio_num_tokens'\]"):
        _lay_out(prompt, ctx, {"image": {"image_grid_thw"}, "audio": {"audio_num_tokens"}})
