"""The tiny model families: deterministic offline builds that transformers loads,
and the torchvision patch that lets their processors import beside CPU torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.tiny_model import build_tiny_model, read_meta
from tools.torchvision_cpu import PATCH_MARKER, matching_version, patch_source

pytestmark = pytest.mark.unit

FAMILIES = ["qwen2_audio", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "whisper"]
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
    ("whisper", {"model"}),  # model.encoder., model.decoder.; proj_out is tied
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


def _vllm_whisper_languages() -> list[str]:
    """vLLM's ``ISO639_1_SUPPORTED_LANGS``, read from its source (importing vLLM takes seconds)."""
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model_executor/models/whisper_utils.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ISO639_1_SUPPORTED_LANGS"
                                                 for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"ISO639_1_SUPPORTED_LANGS not found in {path}")


def test_whisper_processor_and_the_tokens_vllm_prompts_with(built):
    from transformers import AutoConfig, AutoFeatureExtractor, AutoProcessor, AutoTokenizer, GenerationConfig

    path = built["whisper"]
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "WhisperProcessor"
    fe = AutoFeatureExtractor.from_pretrained(path)
    assert (fe.feature_size, fe.sampling_rate, fe.chunk_length, fe.hop_length, fe.n_fft) == (80, 16000, 30, 160, 400)
    feats = processor.feature_extractor(np.zeros(16000, np.float32), sampling_rate=16000, return_tensors="np")
    assert feats["input_features"].shape == (1, 80, 3000)  # padded to 30 s; 1500 encoder positions
    tok = AutoTokenizer.from_pretrained(path)
    assert type(tok).__name__ == "WhisperTokenizer"
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["WhisperForConditionalGeneration"] and config.vocab_size == len(tok)
    vocab = tok.get_vocab()
    sot, eot = vocab["<|startoftranscript|>"], vocab["<|endoftext|>"]
    assert config.decoder_start_token_id == GenerationConfig.from_pretrained(path).decoder_start_token_id == sot
    assert config.eos_token_id == tok.eos_token_id == eot == sot - 1

    # vLLM's decoder prompt (WhisperForConditionalGeneration.get_generation_prompt): one token each.
    for lang in _vllm_whisper_languages():
        for task in ("transcribe", "translate"):
            ids = tok.encode(f"<|startoftranscript|><|{lang}|><|{task}|><|notimestamps|>", add_special_tokens=False)
            assert tok.convert_ids_to_tokens(ids) == ["<|startoftranscript|>", f"<|{lang}|>", f"<|{task}|>",
                                                      "<|notimestamps|>"]
    # transformers finds a language's token by its place after <|startoftranscript|>.
    tok.set_prefix_tokens(language="de", task="translate")
    assert tok.convert_ids_to_tokens(tok.prefix_tokens) == ["<|startoftranscript|>", "<|de|>", "<|translate|>",
                                                            "<|notimestamps|>"]
    # verbose_json: vLLM takes every id from <|0.00|> on as a timestamp, 20 ms apart.
    first = vocab["<|0.00|>"]
    assert vocab["<|30.00|>"] == first + 1500 == len(tok) - 1 and vocab["<|1.00|>"] == first + 50
    assert max(vocab[t] for t in tok.all_special_tokens) < first
    assert tok.decode(tok.encode(" hello world", add_special_tokens=False)) == " hello world"
    assert tok._decode_with_timestamps([first, *tok.encode(" hi", add_special_tokens=False), first + 50]) == \
        "<|0.00|> hi<|1.00|>"


def test_whisper_greedy_output_follows_the_audio(built):
    """transformers' forward pass on the tiny Whisper: two clips give two transcriptions, one clip one."""
    import io

    import soundfile
    import torch
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    from tools.media import make_audio

    path = built["whisper"]
    processor = AutoProcessor.from_pretrained(path)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tok = processor.tokenizer
    prompt = tok.encode("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", add_special_tokens=False)

    def greedy(seed: int, n: int = 40) -> list[int]:
        wave, _ = soundfile.read(io.BytesIO(make_audio(seed=seed, seconds=1.0)), dtype="float32")
        feats = processor.feature_extractor(wave, sampling_rate=16000, return_tensors="pt")["input_features"]
        ids = list(prompt)
        with torch.no_grad():
            enc = model.model.encoder(feats).last_hidden_state
            while len(ids) < len(prompt) + n and ids[-1] != tok.eos_token_id:
                logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids])).logits
                ids.append(int(logits[0, -1].argmax()))
        return ids[len(prompt):]

    a, b = greedy(0), greedy(1)
    assert a != b
    assert greedy(0) == a
    for out in (a, b):  # text, then <|endoftext|> from decoder position 35 on (32 tokens after the prompt)
        assert out[-1] == tok.eos_token_id and len(out) <= 33
        assert all(t < tok.convert_tokens_to_ids("<|0.00|>") for t in out)
        assert tok.decode(out, skip_special_tokens=True).strip()


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


def test_torchaudio_cpu_strips_only_the_compiled_libraries(tmp_path):
    from tools.torchaudio_cpu import strip_compiled

    lib = tmp_path / "torchaudio" / "lib"
    lib.mkdir(parents=True)
    for name in ("_torchaudio.so", "libtorchaudio.so", "__init__.py"):
        (lib / name).write_text("x")
    assert strip_compiled(tmp_path) == ["_torchaudio.so", "libtorchaudio.so"]
    assert [p.name for p in lib.iterdir()] == ["__init__.py"]


def test_the_installed_torchaudio_resamples_beside_cpu_torch():
    """What `make install` leaves (tools/torchaudio_cpu.py): vLLM's default audio resampler works."""
    import numpy as np
    from vllm.multimodal.audio import AudioResampler

    out = AudioResampler(target_sr=16000).resample(np.ones(4800, dtype=np.float32), orig_sr=48000)
    assert out.shape == (1600,)
