"""Tiny Qwen3-VL: ViT (2x64, patch 16, 2x2 merge, DeepStack from block 0) -> Qwen3 LM (2x128) with interleaved M-RoPE.

Images are resized to a multiple of 32 px with between 64x64 and 128x128 pixels
(Qwen3-VL's own rule, smaller bounds), so an image costs 4 to 16
``<|image_pad|>`` tokens.  The LM's rotary embedding is multimodal and
interleaved (``mrope_section`` [6, 5, 5] over a head of 32: temporal, height,
width, as Qwen3-VL's [24, 20, 20] over 128).  DeepStack: the vision tower's
block 0 feeds a second patch merger whose output is added to the LM's layer 0
hidden states, so each image embedding row vLLM computes is
``out_hidden_size * (1 + len(deepstack_visual_indexes))`` = 256 wide.
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common
from tools.tiny_families.qwen2_5_vl import IM_END, IMAGE, PAD, SPECIAL, TURN, V_END, V_START, VIDEO

# Qwen3-VL-Instruct's template: no default system turn.
CHAT_TEMPLATE = ("{% for message in messages %}" + TURN
                 + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

VISION_CONFIG = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                     hidden_act="gelu_pytorch_tanh", num_position_embeddings=64, deepstack_visual_indexes=[0])
TEXT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                   rope_parameters=dict(rope_type="default", mrope_section=[6, 5, 5], mrope_interleaved=True,
                                        rope_theta=5000000.0))
IMAGE_PIXELS = dict(shortest_edge=64 * 64, longest_edge=128 * 128)
VIDEO_PIXELS = dict(shortest_edge=64 * 64, longest_edge=128 * 128)
MEAN_STD = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
PATCHING = dict(patch_size=16, temporal_patch_size=2, merge_size=2)


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    raw = common.train_tokenizer(SPECIAL)
    ids = {t: raw.token_to_id(t) for t in (PAD, IM_END, IMAGE, VIDEO, V_START, V_END)}
    tokenizer = common.tokenizer_fast(raw, CHAT_TEMPLATE, TEXT_CONFIG["max_position_embeddings"],
                                      eos_token=IM_END, pad_token=PAD)
    image_processor = Qwen2VLImageProcessorPil(size=dict(IMAGE_PIXELS), **MEAN_STD, **PATCHING)
    video_processor = Qwen3VLVideoProcessor(size=dict(VIDEO_PIXELS), **MEAN_STD, **PATCHING)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    common.save_processor(processor, out, CHAT_TEMPLATE, pin={"image_processor": type(image_processor).__name__})

    special = dict(bos_token_id=ids[PAD], eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    config = Qwen3VLConfig(
        vision_config=dict(VISION_CONFIG), text_config=dict(TEXT_CONFIG, vocab_size=common.VOCAB_SIZE, **special),
        image_token_id=ids[IMAGE], video_token_id=ids[VIDEO], vision_start_token_id=ids[V_START],
        vision_end_token_id=ids[V_END], tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"], dtype="bfloat16", **special,
    )
    cfg = common.write_config(out, config)
    common.write_generation_config(out, cfg, **special)
    # transformers' names are already the hub layout (model.visual., model.language_model., lm_head.),
    # which vLLM's Qwen3VLForConditionalGeneration.hf_to_vllm_mapper reads.
    common.write_weights(Qwen3VLForConditionalGeneration, config, out, common.derive_seed("qwen3_vl", seed), rename={})
