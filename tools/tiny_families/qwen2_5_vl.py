"""Tiny Qwen2.5-VL: window-attention ViT (2x64, patch 14, 2x2 merge) -> Qwen2 LM (2x128) with M-RoPE.

Images are resized to a multiple of 28 px with between 56x56 and 112x112 pixels
(Qwen2.5-VL's own rule, smaller bounds), so an image costs 4 to 16
``<|image_pad|>`` tokens.  The LM's rotary embedding is multimodal (M-RoPE,
``mrope_section`` [4, 6, 6] over a head of 32: temporal, height, width).
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
PAD, IM_END = "<|endoftext|>", "<|im_end|>"
IMAGE, VIDEO, V_START, V_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"

# One turn of the Qwen-VL templates (shared with qwen3_vl); parts are matched by their ``type``.
TURN = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
)
# Qwen2.5-VL-Instruct's template: a default system turn first.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + TURN + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VISION_CONFIG = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                     fullatt_block_indexes=[1], in_channels=3)
TEXT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                   rope_parameters=dict(rope_type="default", mrope_section=[4, 6, 6], rope_theta=1000000.0))
IMAGE_PIXELS = dict(shortest_edge=56 * 56, longest_edge=112 * 112)
VIDEO_PIXELS = dict(shortest_edge=56 * 56, longest_edge=112 * 112)


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    raw = common.train_tokenizer(SPECIAL)
    ids = {t: raw.token_to_id(t) for t in (PAD, IM_END, IMAGE, VIDEO, V_START, V_END)}
    tokenizer = common.tokenizer_fast(raw, CHAT_TEMPLATE, TEXT_CONFIG["max_position_embeddings"],
                                      eos_token=IM_END, pad_token=PAD)
    image_processor = Qwen2VLImageProcessorPil(size=dict(IMAGE_PIXELS))
    video_processor = Qwen2VLVideoProcessor(size=dict(VIDEO_PIXELS))
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    common.save_processor(processor, out, CHAT_TEMPLATE, pin={"image_processor": type(image_processor).__name__})

    special = dict(bos_token_id=ids[PAD], eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    config = Qwen2_5_VLConfig(
        vision_config=dict(VISION_CONFIG), text_config=dict(TEXT_CONFIG, vocab_size=common.VOCAB_SIZE, **special),
        image_token_id=ids[IMAGE], video_token_id=ids[VIDEO], vision_start_token_id=ids[V_START],
        vision_end_token_id=ids[V_END], tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"], dtype="bfloat16", **special,
    )
    cfg = common.write_config(out, config)
    common.write_generation_config(out, cfg, **special)
    common.write_weights(
        Qwen2_5_VLForConditionalGeneration, config, out, common.derive_seed("qwen2_5_vl", seed),
        rename={"model.visual.": "visual.", "model.language_model.": "model."},
    )
