"""Tiny Whisper: encoder 2x64 (two convs, the second stride 2) -> decoder 2x64 with cross-attention.

Speech to text only (vLLM's ``/v1/audio/transcriptions`` and ``/v1/audio/translations``;
no chat template).  Audio is resampled to 16 kHz and turned into 80-bin log-mel
features over a 30 s window (3000 frames -> 1500 encoder positions), as in
whisper-tiny ... large-v2.  The vocabulary is laid out as Whisper's: byte-level
BPE, then ``<|endoftext|>``, ``<|startoftranscript|>``, one ``<|xx|>`` per
language in Whisper's order (the 100 of large-v3, a superset of the 57 vLLM
accepts), ``<|translate|>``, ``<|transcribe|>``, ``<|startoflm|>``,
``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>``, and last the 1501
timestamp tokens ``<|0.00|>`` ... ``<|30.00|>`` (non-special, as in the hub
tokenizers: transformers and vLLM's ``verbose_json`` segments find them as the
ids from ``<|0.00|>`` on).

Random weights are N(0, 0.02), except that (:func:`_adjust_weights`)
- the convolutions are scaled up (the clip, not the sinusoidal positions,
  dominates the encoder's input) and so are the cross-attention projections
  (peaked attention over the 1500 encoder positions, and a contribution that
  outweighs the token embeddings): greedy output follows the audio, two clips
  give different transcriptions;
- the timestamp tokens' embeddings are halved: after ``<|notimestamps|>`` the
  output is text (vLLM's ``verbose_json``, which prompts with ``<|0.00|>``,
  then finds no segments);
- the decoder's positions from :data:`EOT_POSITION` on point at
  ``<|endoftext|>``: a transcription ends after at most 32 tokens;
- the encoder's positions are Whisper's sinusoids, as hub checkpoints store them.
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common

# Byte-level BPE ids 0..TEXT_VOCAB-1, then the special tokens (Whisper: 50257 BPE tokens, then these).
TEXT_VOCAB = common.VOCAB_SIZE - 1
EOT, SOT, NO_TIMESTAMPS, PREV = "<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>"
TASKS = ("translate", "transcribe")
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, 20 ms apart
MAX_TARGET_POSITIONS = 448

CONFIG = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
              decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
              max_source_positions=1500, max_target_positions=MAX_TARGET_POSITIONS)

# Multipliers of the N(0, 0.02) weights (by name suffix) that make greedy decoding follow the audio.
SCALES = {
    "conv1.weight": 10.0,
    "conv2.weight": 10.0,
    "encoder_attn.q_proj.weight": 15.0,
    "encoder_attn.k_proj.weight": 15.0,
    "encoder_attn.v_proj.weight": 10.0,
    "encoder_attn.out_proj.weight": 10.0,
}

# Timestamp tokens' embedding rows (tied to the logits) times this: greedy decoding after
# <|notimestamps|> writes text, not "<|12.34|>" (not special tokens, so they would show in the text).
TIMESTAMP_SCALE = 0.5
# From this decoder position on, the learned position embedding points at <|endoftext|> (EOT_PUSH
# times its unit embedding): greedy decoding after the usual 4-token prompt ends, as a real
# transcription does, after at most EOT_POSITION - 3 = 32 text tokens.
EOT_POSITION = 35
EOT_PUSH = 32.0


def languages() -> list[str]:
    """Whisper's language codes in token order (transformers' table: the 100 of large-v3)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return list(LANGUAGES)


def special_tokens() -> list[str]:
    return ([EOT, SOT] + [f"<|{code}|>" for code in languages()]
            + [f"<|{task}|>" for task in TASKS] + ["<|startoflm|>", PREV, "<|nospeech|>", NO_TIMESTAMPS])


def timestamp_tokens() -> list[str]:
    return [f"<|{i * 0.02:.2f}|>" for i in range(TIMESTAMPS)]


def _tokenizer():
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    raw = common.train_tokenizer([], vocab_size=TEXT_VOCAB)
    special = special_tokens()
    raw.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    raw.add_tokens([AddedToken(t, normalized=False, special=False) for t in timestamp_tokens()])
    return WhisperTokenizer(tokenizer_object=raw, extra_special_tokens=special, pad_token=EOT,
                            model_max_length=MAX_TARGET_POSITIONS)


def _adjust_weights(path: pathlib.Path, max_source_positions: int, first_timestamp: int, eot: int) -> None:
    """Rewrite ``model.safetensors`` with the changes listed in the module's docstring."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.whisper.modeling_whisper import sinusoids

    tensors = load_file(str(path))
    for name in sorted(tensors):
        for suffix, factor in SCALES.items():
            if name.endswith(suffix):
                tensors[name] = (tensors[name].float() * factor).to(torch.bfloat16).contiguous()
    name = "model.decoder.embed_tokens.weight"  # tied to proj_out: scales the timestamps' logits
    emb = tensors[name].float()
    emb[first_timestamp:] *= TIMESTAMP_SCALE
    tensors[name] = emb.to(torch.bfloat16).contiguous()
    name = "model.decoder.embed_positions.weight"
    pos = tensors[name].float()
    pos[EOT_POSITION:] += EOT_PUSH * emb[eot] / emb[eot].norm()
    tensors[name] = pos.to(torch.bfloat16).contiguous()
    name = "model.encoder.embed_positions.weight"
    tensors[name] = sinusoids(max_source_positions, tensors[name].shape[1]).to(torch.bfloat16).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    tokenizer = _tokenizer()
    features = WhisperFeatureExtractor(feature_size=CONFIG["num_mel_bins"], sampling_rate=16000,
                                       chunk_length=30, hop_length=160, n_fft=400)
    processor = WhisperProcessor(feature_extractor=features, tokenizer=tokenizer)
    processor.save_pretrained(str(out))

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (EOT, SOT, NO_TIMESTAMPS, PREV)}
    special = dict(bos_token_id=ids[EOT], eos_token_id=ids[EOT], pad_token_id=ids[EOT],
                   decoder_start_token_id=ids[SOT])
    config = WhisperConfig(**CONFIG, vocab_size=len(tokenizer), architectures=["WhisperForConditionalGeneration"],
                           begin_suppress_tokens=None, dtype="bfloat16", **special)
    cfg = common.write_config(out, config)
    langs = {f"<|{code}|>": tokenizer.convert_tokens_to_ids(f"<|{code}|>") for code in languages()}
    # What transformers' WhisperForConditionalGeneration.generate needs for language= / task=;
    # no forced_decoder_ids and nothing suppressed (vLLM reads neither), so both decode alike.
    common.write_generation_config(
        out, cfg, **special, max_length=MAX_TARGET_POSITIONS, is_multilingual=True, lang_to_id=langs,
        task_to_id={task: tokenizer.convert_tokens_to_ids(f"<|{task}|>") for task in TASKS},
        no_timestamps_token_id=ids[NO_TIMESTAMPS], prev_sot_token_id=ids[PREV], suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    common.write_weights(WhisperForConditionalGeneration, config, out, common.derive_seed("whisper", seed),
                         rename={}, skip=("proj_out.",))
    _adjust_weights(out / "model.safetensors", CONFIG["max_source_positions"],
                    first_timestamp=tokenizer.convert_tokens_to_ids("<|0.00|>"), eot=ids[EOT])
