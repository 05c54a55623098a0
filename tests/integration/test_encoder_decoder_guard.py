"""Issue 25's guard, and issue 35's path past it: vLLM 0.32 never loads a transferred encoder output into
an encoder-decoder model's (Whisper-class) cross-attention by itself, so an LM fed from an encoder would
decode without the audio, silently. Where issue 35's path is verified (vLLM 0.32's V1 runner, which our
worker's runner extends: tests/integration/test_whisper_apart_seam.py) the encoder serves such a model and
the LM is its EC consumer (tests/e2e/test_transcriptions.py runs it); elsewhere the encoder service refuses
the model before any engine starts and the LM is a plain engine that encodes the audio itself."""

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


def test_the_encoders_guard_refuses_an_encoder_decoder_model_where_the_path_is_not_verified(
        tiny_whisper_config, monkeypatch):
    """The guard the encoder service runs first (``services.encoder.server.serve``), in this process: where the
    path is not verified (here: vLLM's V2 model runner asked for; vLLM reads the variable when asked)."""
    from services.common.engine import EngineConfig, UnsupportedModel, refuse_encoder_decoder

    refuse_encoder_decoder(EngineConfig(model=tiny_whisper_config), "encoder")  # verified here: served
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(UnsupportedModel, match="is an encoder-decoder model.*decode without the audio"):
        refuse_encoder_decoder(EngineConfig(model=tiny_whisper_config), "encoder")


@pytest.mark.slow  # `epd encoder` loads vLLM in a process of its own (about 30 s on a busy 2-core host); the
# guard itself runs in the test above, and the command's exit status 2 for it is one `except` in services/cli.py
def test_the_encoder_refuses_an_encoder_decoder_model_before_starting_an_engine(tiny_whisper_config):
    """Where the path is not verified (here: vLLM's V2 model runner asked for)."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "encoder", "--model", tiny_whisper_config,
                           "--port", "0"], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1"))
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "is an encoder-decoder model" in proc.stderr and "decode without the audio" in proc.stderr, \
        proc.stderr[-2000:]
    assert "EngineCore" not in proc.stderr  # refused before any engine process was started


def test_the_lm_is_an_ec_consumer_for_an_encoder_decoder_model_where_the_path_is_verified(
        tiny_whisper_config, tiny_model, monkeypatch):
    from services.common.engine import EngineConfig
    from services.lm.server import ec_consumer

    assert ec_consumer(EngineConfig(model=tiny_whisper_config))
    assert ec_consumer(EngineConfig(model=tiny_model))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # read at start, as the services read it
    assert not ec_consumer(EngineConfig(model=tiny_whisper_config))  # a plain engine: no connector at all
    assert ec_consumer(EngineConfig(model=tiny_model))


def test_a_decoder_only_model_passes_the_encoders_guard(tiny_model):
    from services.common.engine import EngineConfig, refuse_encoder_decoder

    refuse_encoder_decoder(EngineConfig(model=tiny_model), "encoder")  # no exception


def test_each_engine_call_of_an_encoder_decoder_model_names_only_its_own_windows_source():
    """ConsumerEngine, the last place before vLLM: vLLM's speech-to-text serving makes one engine call per
    window with one SamplingParams object; each call gets, on a copy of its own, the source of the window
    its rendered input names (``mm_hashes``), and a call that names none (a language detection) none."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from ectransfer.connector.metadata import ECTransferParams, ItemSource
    from services.lm.context import CURRENT, RequestContext
    from services.lm.frontend import ConsumerEngine

    calls = []
    engine = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=True),
                             generate=lambda prompt, params, rid, **kw: calls.append((rid, params)))
    consumer = object.__new__(ConsumerEngine)  # its renderer is not needed here
    consumer._engine, consumer.encoder_decoder = engine, True
    ctx = RequestContext(media=None)
    for w in "ab":
        ctx.sources[w * 64] = ItemSource(f"127.0.0.1:{ord(w)}", 64, "bfloat16", "claim")
    shared = SamplingParams(max_tokens=4)
    token = CURRENT.set(ctx)
    try:
        for rid, hashes in (("w0", ["a" * 64]), ("w1", ["b" * 64]), ("lang", [])):
            prompt = {"type": "enc_dec", "encoder_prompt": {"prompt_token_ids": []},
                      "decoder_prompt": {"prompt_token_ids": [1], "mm_hashes": {"audio": hashes} if hashes else {}}}
            consumer.generate(prompt, shared, rid)
    finally:
        CURRENT.reset(token)
    named = {rid: set(ECTransferParams.from_dict((p.extra_args or {}).get("ec_transfer_params")).items)
             for rid, p in calls}
    assert named == {"w0": {"a" * 64}, "w1": {"b" * 64}, "lang": set()}
    assert shared.extra_args is None  # the serving's own object is left as it was
