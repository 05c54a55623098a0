"""vLLM serves each tiny model family on CPU: one chat request with one image
(one audio clip for Qwen2-Audio) returns tokens, and vLLM expands the
placeholder to exactly as many tokens as the family's transformers processor.

Each family runs in its own interpreter (``python -m`` this module), so one
engine lives at a time and its memory is returned when the process exits.

Slow (``make test-all``): the default run covers the same path with the checkpoints
``epd tiny-model`` builds, in tests/e2e/test_families.py (plain vLLM generates for every
family, and its expanded prompt equals the transformers processor's); this one builds
each family afresh in a temporary folder.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = {  # family -> (modality, placeholder token, max_model_len)
    "qwen2_audio": ("audio", "<|AUDIO|>", 1024),
    "qwen2_5_vl": ("image", "<|image_pad|>", 1024),
    "qwen3_vl": ("image", "<|image_pad|>", 1024),
    "gemma3": ("image", "<image_soft_token>", 1024),
    "llava": ("image", "<image>", 1024),
}
MAX_TOKENS = 4
RESULT = "tiny-family-result: "  # prefixes the child's JSON line (vLLM logs to stdout too)


def _png_data_url() -> tuple[str, object]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


def _wav_data_url() -> tuple[str, object]:
    import numpy as np
    import soundfile

    t = np.arange(16000, dtype=np.float32) / 16000  # 1 s at 16 kHz: 25 audio tokens
    wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, wave, 16000, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode(), wave


def _run_family(family: str, path: str) -> dict:
    """Child process: one engine, one chat request; prints a JSON summary."""
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    modality, placeholder, max_len = FAMILIES[family]
    if modality == "audio":
        url, media = _wav_data_url()
        part = {"type": "audio_url", "audio_url": {"url": url}}
    else:
        url, media = _png_data_url()
        part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    limits = {modality: 1}
    if family in ("qwen2_5_vl", "qwen3_vl"):
        limits["video"] = 0
    llm = LLM(model=path, max_model_len=max_len, enforce_eager=True, dtype="bfloat16", seed=0,
              limit_mm_per_prompt=limits, kv_cache_memory_bytes=64 << 20, max_num_seqs=2)
    out = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]

    processor = AutoProcessor.from_pretrained(path)
    hf_messages = [{"role": "user", "content": [{"type": modality}, {"type": "text", "text": "What is this?"}]}]
    prompt = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    kw = {"audio": media, "sampling_rate": 16000} if modality == "audio" else {"images": [media]}
    hf_ids = processor(text=[prompt], return_tensors="np", **kw)["input_ids"][0].tolist()
    token_id = processor.tokenizer.convert_tokens_to_ids(placeholder)
    return {
        "output_ids": list(out.outputs[0].token_ids),
        "vllm_placeholders": out.prompt_token_ids.count(token_id),
        "hf_placeholders": hf_ids.count(token_id),
        "same_prompt": out.prompt_token_ids == hf_ids,
    }


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from tools.tiny_model import build_tiny_model

    def build(family: str) -> str:
        return str(build_tiny_model(tmp_path_factory.getbasetemp() / family, family=family))

    return build


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_generates_with_one_item_and_expands_it_like_transformers(family, family_dir):
    path = family_dir(family)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_tiny_families_vllm", family, path], capture_output=True, text=True,
                          timeout=540, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    assert lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len(RESULT):])
    assert len(result["output_ids"]) == MAX_TOKENS
    assert result["vllm_placeholders"] > 0
    assert result["vllm_placeholders"] == result["hf_placeholders"]
    assert result["same_prompt"], result


if __name__ == "__main__":
    print(RESULT + json.dumps(_run_family(sys.argv[1], sys.argv[2])), flush=True)
