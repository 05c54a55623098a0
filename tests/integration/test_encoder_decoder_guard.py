"""Issue 25's guard: an encoder-decoder model (Whisper-class) is refused by the LM and the encoder
service before any engine starts. vLLM 0.32 never loads a transferred encoder output into such a
model's cross-attention, so an LM fed from an encoder would decode without the audio, silently;
a clear refusal is the only safe answer until the LM injects it itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_whisper_config(tmp_path_factory) -> str:
    """A Whisper config alone (no weights, no tokenizer): the refusal reads the config only."""
    from transformers import WhisperConfig

    path = tmp_path_factory.mktemp("tiny-whisper")
    WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64).save_pretrained(path)
    return str(path)


def test_lm_and_encoder_refuse_an_encoder_decoder_model_before_starting_an_engine(tiny_whisper_config):
    procs = {role: subprocess.Popen([sys.executable, "-m", "services.cli", role, "--model", tiny_whisper_config,
                                     "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("lm", "encoder")}
    for role, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, (role, out[-2000:], err[-2000:])
        assert "is an encoder-decoder model" in err and "decode without the audio" in err, err[-2000:]
        assert "EngineCore" not in err  # refused before any engine process was started


def test_a_decoder_only_model_passes_the_guard(tiny_model):
    from services.common.engine import EngineConfig, refuse_encoder_decoder

    refuse_encoder_decoder(EngineConfig(model=tiny_model), "LM")  # no exception
