"""vLLM serves the tiny offline Whisper (``epd tiny-model PATH --family whisper``) on CPU.

One engine in a child interpreter (``python -m`` this module; its memory is returned when it exits),
``vllm.LLM`` with the prompts vLLM's speech-to-text front end builds (``get_generation_prompt``,
``get_language_detection_prompt``, ``get_speech_to_text_config`` of vLLM's
``WhisperForConditionalGeneration``), greedy: two clips give different transcriptions, the same clip
the same one, each ending with ``<|endoftext|>``; a translation differs from the transcription (its
``<|translate|>`` token is in the decoder prompt); language detection returns one of vLLM's codes.

Slow (``make test-all``); tests/e2e/test_transcriptions.py covers the HTTP routes against ``vllm serve``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESULT = "tiny-whisper-result: "  # prefixes the child's JSON line (vLLM logs to stdout too)
MAX_TOKENS = 40  # more than the tiny Whisper writes before <|endoftext|> (32 text tokens at most)


def _clip(seed: int, seconds: float = 1.0):
    import soundfile

    from tools.media import make_audio

    wave, rate = soundfile.read(io.BytesIO(make_audio(seed=seed, seconds=seconds)), dtype="float32")
    assert rate == 16000
    return wave


def _run(path: str) -> dict:
    """Child process: one engine; prints a JSON summary."""
    from vllm import LLM, SamplingParams
    from vllm.config.speech_to_text import SpeechToTextParams
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration as Whisper

    llm = LLM(model=path, max_model_len=448, enforce_eager=True, dtype="bfloat16", seed=0,
              limit_mm_per_prompt={"audio": 1}, kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    model_config = llm.model_config
    stt = Whisper.get_speech_to_text_config(model_config, "transcribe")

    def prompt(seed: int, task: str = "transcribe"):
        return Whisper.get_generation_prompt(SpeechToTextParams(
            audio=_clip(seed), stt_config=stt, model_config=model_config, language="en", task_type=task))

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [prompt(0), prompt(1), prompt(0), prompt(0, "translate")]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    detect = llm.generate(Whisper.get_language_detection_prompt(_clip(0), stt), SamplingParams(
        temperature=0.0, max_tokens=1, allowed_token_ids=Whisper.get_language_token_ids(tokenizer)), use_tqdm=False)
    return {
        "stt": {"max_audio_clip_s": stt.max_audio_clip_s, "sample_rate": stt.sample_rate},
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "decoder_prompt": tokenizer.convert_ids_to_tokens(outs[3].prompt_token_ids),
        "language": Whisper.parse_language_detection_output(list(detect[0].outputs[0].token_ids), tokenizer),
        "languages": sorted(Whisper.supported_languages),
        "eos": tokenizer.eos_token_id,
        "first_timestamp": tokenizer.convert_tokens_to_ids("<|0.00|>"),
    }


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    from tools.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path_factory.mktemp("tiny-whisper") / "whisper", family="whisper"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_tiny_whisper_vllm", path],
                          capture_output=True, text=True, timeout=540, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    assert lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len(RESULT):])


def test_vllm_transcribes_the_tiny_whisper_greedily_and_the_output_follows_the_audio(result):
    a, b, a_again, translated = result["tokens"]
    assert result["stt"] == {"max_audio_clip_s": 30, "sample_rate": 16000}
    assert a != b, result["texts"]
    assert a == a_again
    assert translated != a
    assert result["decoder_prompt"] == ["<|startoftranscript|>", "<|en|>", "<|translate|>", "<|notimestamps|>"]
    for tokens, text, finish in zip(result["tokens"], result["texts"], result["finish"]):
        assert finish == "stop" and tokens[-1] == result["eos"] and len(tokens) <= 33, (tokens, finish)
        assert all(t < result["first_timestamp"] for t in tokens)  # text, no "<|1.23|>"
        assert text.strip()


def test_vllm_detects_a_language_among_its_own_codes(result):
    assert result["language"] in result["languages"]


if __name__ == "__main__":
    print(RESULT + json.dumps(_run(sys.argv[1])), flush=True)
