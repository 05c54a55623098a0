"""The tiny model families: deterministic offline builds that transformers loads,
and the torchvision patch that lets their processors import beside CPU torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.tiny_model import build_tiny_model, read_meta
from tools.torchvision_cpu import PATCH_MARKER, matching_version, patch_source

pytestmark = pytest.mark.unit

FAMILIES = ["qwen2_audio", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava"]
VISION = ["qwen2_5_vl", "qwen3_vl", "gemma3", "llava"]


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_builds_of_a_family_are_byte_identical_and_differ_from_another_seed(family, tmp_path):
    a = build_tiny_model(tmp_path / "a", family=family)
    b = build_tiny_model(tmp_path / "b", family=family)
    files_a, files_b = _files(a), _files(b)
    assert sorted(files_a) == sorted(files_b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= set(files_a)
    for name in files_a:
        assert files_a[name] == files_b[name], name
    assert read_meta(a) == {"family": family, "format_version": 1, "seed": 0, "variant": "tiny"}
    c = build_tiny_model(tmp_path / "c", family=family, seed=1)
    assert _files(c)["model.safetensors"] != files_a["model.safetensors"]
    assert _files(c)["tokenizer.json"] == files_a["tokenizer.json"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_model(root / f, family=f) for f in FAMILIES}


def _chat(processor, modality):
    messages = [{"role": "user", "content": [{"type": modality}, {"type": "text", "text": "What is this?"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("family,placeholder,count", [
    ("qwen2_5_vl", "<|image_pad|>", 12),     # 84x112 px after resizing: 6x8 patches, merged 2x2
    ("qwen3_vl", "<|image_pad|>", 8),        # 64x128 px after resizing: 4x8 patches, merged 2x2
    ("gemma3", "<image_soft_token>", 16),    # always 112 px: 8x8 patches pooled 2x2
    ("llava", "<image>", 64),                # 112 px crop: 8x8 patches, CLS dropped
])
def test_vision_processors_load_offline_and_expand_one_image(built, family, placeholder, count):
    pytest.importorskip("torchvision")  # the vision processors need it (make install provides it)
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    path = built[family]
    processor = AutoProcessor.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    assert AutoConfig.from_pretrained(path).architectures[0].endswith("ForConditionalGeneration")
    out = processor(text=[_chat(processor, "image")], images=[Image.new("RGB", (120, 80))])
    ids = list(out["input_ids"][0])
    assert ids.count(processor.tokenizer.convert_tokens_to_ids(placeholder)) == count


def test_qwen2_audio_processor_gives_one_token_per_40ms(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built["qwen2_audio"])
    out = processor(text=[_chat(processor, "audio")], audio=[np.zeros(16000, np.float32)], sampling_rate=16000)
    assert list(out["input_ids"][0]).count(processor.audio_token_id) == 25


def test_gemma3_newline_runs_are_single_tokens_and_image_projection_is_not_zero(built):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["gemma3"])
    vocab = tok.get_vocab()
    runs = [vocab["\n" * n] for n in range(1, 5)]
    assert len(set(runs)) == 4
    assert tok.encode("a\n\n\nb", add_special_tokens=False)[1] == vocab["\n\n\n"]
    with safe_open(str(built["gemma3"] / "model.safetensors"), "pt") as f:
        assert f.get_tensor("multi_modal_projector.mm_input_projection_weight").float().abs().sum() > 0
        assert "language_model.lm_head.weight" not in f.keys()  # tied to the embeddings


@pytest.mark.parametrize("family,prefixes", [
    ("qwen2_audio", {"audio_tower", "multi_modal_projector", "language_model"}),
    ("qwen2_5_vl", {"visual", "model", "lm_head"}),
    ("qwen3_vl", {"model", "lm_head"}),  # model.visual., model.language_model.
    ("gemma3", {"vision_tower", "multi_modal_projector", "language_model"}),
    ("llava", {"vision_tower", "multi_modal_projector", "language_model"}),
])
def test_weights_use_the_hub_layout_vllm_loads(built, family, prefixes):
    from safetensors import safe_open

    with safe_open(str(built[family] / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert {k.split(".")[0] for k in keys} == prefixes
    if "vision_tower" in prefixes:
        assert all(k.startswith("vision_tower.vision_model.") for k in keys if k.startswith("vision_tower"))
    cfg = json.loads((built[family] / "config.json").read_text())
    assert cfg["architectures"] and cfg["torch_dtype"] == "bfloat16"


def test_unknown_family_or_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choose from"):
        build_tiny_model(tmp_path / "x", family="nope")
    with pytest.raises(ValueError, match="choose from"):
        build_tiny_model(tmp_path / "x", family="gemma3", variant="bench")


_META = '''import torch
def register_meta(op_name):
    pass

@register_meta("roi_align")
def meta_roi_align(x):
    return x


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets):
    return dets
'''


def test_torchvision_patch_guards_every_register_fake_once():
    patched = patch_source(_META)
    assert "@torch.library.register_fake(" not in patched
    assert patched.count('@_register_fake_if_ops("torchvision::') == 2
    assert patched.count(PATCH_MARKER) == 1
    assert patch_source(patched) == patched
    compile(patched, "<patched>", "exec")


def test_torchvision_release_follows_the_torch_release():
    assert matching_version("2.13.0+cpu") == "0.28.0"
    assert matching_version("2.14.1") == "0.29.1"
    with pytest.raises(ValueError):
        matching_version("1.13.0")
