"""Issue 25's guard: vLLM 0.32 never loads a transferred encoder output into an encoder-decoder
model's (Whisper-class) cross-attention by itself, so an LM fed from an encoder would decode without the
audio, silently. The encoder service refuses such a model before any engine starts where issue 35's
path is not verified (tests/integration/test_whisper_apart_seam.py); the LM (not wired yet) serves it as a
plain engine that is no EC consumer (it encodes the audio itself), and refuses any item that names an
encoder (tests/e2e/test_transcriptions.py sends one to a running Whisper LM)."""

from __future__ import annotations

import os
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


def test_the_encoder_serves_an_encoder_decoder_model_only_where_the_path_is_verified():
    """Issue 35: vLLM 0.32's V1 runner (our worker's); tests/integration/test_whisper_apart_seam.py runs it."""
    from services.common.engine import EngineConfig, encoder_apart_verified

    assert encoder_apart_verified(EngineConfig(model="unused"))


def test_the_encoder_refuses_an_encoder_decoder_model_before_starting_an_engine(tiny_whisper_config):
    """Where the path is not verified (here: vLLM's V2 model runner asked for)."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "encoder", "--model", tiny_whisper_config,
                           "--port", "0"], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1"))
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "is an encoder-decoder model" in proc.stderr and "decode without the audio" in proc.stderr, \
        proc.stderr[-2000:]
    assert "EngineCore" not in proc.stderr  # refused before any engine process was started


def test_the_lm_is_no_ec_consumer_for_an_encoder_decoder_model(tiny_whisper_config, tiny_model):
    from services.common.engine import EngineConfig
    from services.lm.server import ec_consumer

    assert not ec_consumer(EngineConfig(model=tiny_whisper_config))  # a plain engine: no connector at all
    assert ec_consumer(EngineConfig(model=tiny_model))


def test_a_decoder_only_model_passes_the_encoders_guard(tiny_model):
    from services.common.engine import EngineConfig, refuse_encoder_decoder

    refuse_encoder_decoder(EngineConfig(model=tiny_model), "encoder")  # no exception


def test_a_request_to_an_encoder_decoder_model_is_never_given_ec_transfer_params():
    """ConsumerEngine, the last place before vLLM: a request whose items name an encoder is refused on an
    encoder-decoder model's engine, before the engine sees it."""
    from types import SimpleNamespace

    from ectransfer.connector.metadata import ItemSource
    from services.common.errors import BadInput
    from services.lm.context import CURRENT, RequestContext
    from services.lm.frontend import ConsumerEngine

    calls = []
    engine = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=True),
                             generate=lambda *a, **k: calls.append((a, k)))
    consumer = object.__new__(ConsumerEngine)  # its renderer is not needed here
    consumer._engine = engine
    ctx = RequestContext(media=None)
    ctx.sources["x" * 64] = ItemSource("127.0.0.1:1", 64, "bfloat16", "claim")
    token = CURRENT.set(ctx)
    try:
        with pytest.raises(BadInput, match="takes no encoder outputs"):
            consumer.generate("prompt", SimpleNamespace(extra_args=None), "rid")
    finally:
        CURRENT.reset(token)
    assert calls == []
