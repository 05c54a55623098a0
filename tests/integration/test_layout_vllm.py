"""The LM's prompt layout from encoder metadata equals vLLM's own processing,
token for token and range for range, on the tiny model and on a copy of it
whose processor splits images into tiles (rows of tiles, newlines between
them: the case where a splice could go wrong). No engine: vLLM's
InputProcessor alone, with the processor cache off so every call processes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from services.common.engine import tokenize
from services.common.layout import item_layouts, mask_bytes, placeholder_ranges, splice

pytestmark = pytest.mark.integration

SIZES = [(768, 512), (300, 200), (1500, 40), (64, 900), (112, 112)]


def _processor(model: str):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    cfg = EngineArgs(model=model, dtype="bfloat16", seed=0, enforce_eager=True, mm_processor_cache_gb=0,
                     limit_mm_per_prompt={"image": 8}).create_engine_config()
    return InputProcessor(cfg)


@pytest.fixture(scope="module", params=["tiny", "tiled"])
def proc(request, tiny_model, tmp_path_factory):
    model = tiny_model
    if request.param == "tiled":  # same weights and tokenizer; tiles of 112 px up to 336 px a side
        model = str(tmp_path_factory.mktemp("tiled") / "model")
        shutil.copytree(tiny_model, model)
        path = os.path.join(model, "processor_config.json")
        with open(path) as f:
            cfg = json.load(f)
        image_processor = cfg.get("image_processor", cfg)
        image_processor["size"]["longest_edge"] = 336
        with open(path, "w") as f:
            json.dump(cfg, f)
    return _processor(model)


def _run(proc, prompt: str, images, uuids):
    from vllm import SamplingParams

    return proc.process_inputs("r", {"prompt": prompt, "multi_modal_data": {"image": images},
                                     "multi_modal_uuids": {"image": uuids}},
                               SamplingParams(max_tokens=1), supported_tasks=("generate",))


def _encoder_layouts(proc, placeholder: str, images, uuids):
    """What the encoder service sends: its own processing of n placeholders."""
    req = _run(proc, placeholder * len(images), images, uuids)
    return item_layouts(tokenize(proc.renderer, placeholder * len(images)), req.prompt_token_ids,
                        placeholder_ranges(req.mm_features))


def _placeholder(proc) -> str:
    from vllm.model_executor.models.registry import ModelRegistry

    mc = proc.model_config
    return ModelRegistry.resolve_model_cls(mc.architectures, mc)[0].get_placeholder_str("image", 1)


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_laid_out_prompt_equals_vllms_processing(proc, n_images):
    rng = np.random.default_rng(n_images)
    placeholder = _placeholder(proc)
    for start in range(0, len(SIZES), n_images):
        sizes = [SIZES[(start + k) % len(SIZES)] for k in range(n_images)]
        images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
        uuids = [f"img-{start}-{k}" for k in range(n_images)]
        layouts = _encoder_layouts(proc, placeholder, images, uuids)
        assert layouts is not None and len(layouts) == n_images
        content = [{"type": "text", "text": "Compare"}]
        for k in range(n_images):
            content += [{"type": "image"}, {"type": "text", "text": f" and{k}\n"}]
        chat = proc.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                         add_generation_prompt=True)
        prompts = [chat,
                   "x" + placeholder * n_images + "y",  # placeholders back to back, text glued on
                   placeholder * n_images]
        for prompt in prompts:
            want = _run(proc, prompt, images, uuids)
            ids, positions = splice(tokenize(proc.renderer, prompt), layouts)
            assert ids == want.prompt_token_ids, prompt
            assert positions == [(f.mm_position.offset, f.mm_position.length) for f in want.mm_features]
            for lay, f in zip(layouts, want.mm_features):
                assert lay.num_embeds == f.mm_position.get_num_embeds()
                assert lay.is_embed == mask_bytes(f.mm_position.is_embed)


def test_the_tiled_copy_really_tiles(proc):
    """Guards the test above: the tiled processor lays out several tiles."""
    img = Image.new("RGB", (768, 512))
    layouts = _encoder_layouts(proc, _placeholder(proc), [img], ["t"])
    tiles = layouts[0].num_embeds // 16
    assert tiles == 1 if proc.model_config.model.endswith("tiny-idefics3") else tiles > 2


def test_text_holding_the_image_token_beside_one_image_is_laid_out_as_vllm_processes_it(proc):
    """A client's text that holds the model's image placeholder, and one image: vLLM's processor gives the
    first placeholder the image and keeps the others as tokens (no refusal); the splice does the same."""
    placeholder = _placeholder(proc)
    img = Image.fromarray(np.random.default_rng(7).integers(0, 255, (200, 300, 3), dtype=np.uint8))
    layouts = _encoder_layouts(proc, placeholder, [img], ["one"])
    content = [{"type": "text", "text": f"what is {placeholder} here?"}, {"type": "image"}]
    chat = proc.get_tokenizer().apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
    for prompt in (chat, f"a{placeholder}b{placeholder}{placeholder}"):
        want = _run(proc, prompt, [img], ["one"])
        ids, positions = splice(tokenize(proc.renderer, prompt), layouts)
        assert ids == want.prompt_token_ids, prompt
        assert positions == [(f.mm_position.offset, f.mm_position.length) for f in want.mm_features]
