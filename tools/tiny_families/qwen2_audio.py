"""Tiny Qwen2-Audio: Whisper-style encoder (2x64) -> linear projector -> Qwen2 LM (2x128).

Audio is resampled to 16 kHz and turned into 128-bin log-mel features over a
30 s window, as in Qwen2-Audio-7B; the encoder (conv stride 2, then 2x average
pooling) gives one ``<|AUDIO|>`` token per 40 ms of audio, at most 750 per clip.
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
PAD, IM_END, AUDIO = "<|endoftext|>", "<|im_end|>", "<|AUDIO|>"

# Qwen2-Audio-7B-Instruct's template; parts are matched by their ``type``.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

AUDIO_CONFIG = dict(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                    num_mel_bins=128, max_source_positions=1500)
TEXT_CONFIG = dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    raw = common.train_tokenizer(SPECIAL)
    ids = {t: raw.token_to_id(t) for t in (PAD, IM_END, AUDIO)}
    tokenizer = common.tokenizer_fast(raw, CHAT_TEMPLATE, TEXT_CONFIG["max_position_embeddings"],
                                      eos_token=IM_END, pad_token=PAD)
    features = WhisperFeatureExtractor(feature_size=AUDIO_CONFIG["num_mel_bins"], sampling_rate=16000,
                                       chunk_length=30, hop_length=160, n_fft=400)
    processor = Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    common.save_processor(processor, out, CHAT_TEMPLATE, pin={})

    special = dict(bos_token_id=ids[PAD], eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    config = Qwen2AudioConfig(
        audio_config=dict(AUDIO_CONFIG), text_config=dict(TEXT_CONFIG, vocab_size=common.VOCAB_SIZE, **special),
        audio_token_index=ids[AUDIO], architectures=["Qwen2AudioForConditionalGeneration"], dtype="bfloat16",
    )
    cfg = common.write_config(out, config)
    common.write_generation_config(out, cfg, **special)
    common.write_weights(
        Qwen2AudioForConditionalGeneration, config, out, common.derive_seed("qwen2_audio", seed),
        rename={"model.audio_tower.": "audio_tower.", "model.multi_modal_projector.": "multi_modal_projector.",
                "model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
    )
