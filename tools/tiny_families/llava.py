"""Tiny LLaVA-1.5: CLIP ViT (2x64, 112 px, patch 14) -> 2-layer GELU MLP -> Llama LM (2x128).

Images are resized (shortest edge 112) and center-cropped to 112x112; the
second-to-last vision layer's patch features (CLS dropped) become 64 ``<image>``
tokens per image, as in llava-hf/llava-1.5-7b-hf.
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
UNK, BOS, EOS, PAD, IMAGE = SPECIAL

# llava-1.5-hf's template; parts are matched by their ``type``.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

VISION_CONFIG = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, image_size=112, patch_size=14, projection_dim=64)
TEXT_CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    raw = common.train_tokenizer(SPECIAL)
    ids = {t: raw.token_to_id(t) for t in SPECIAL}
    tokenizer = common.tokenizer_fast(raw, CHAT_TEMPLATE, TEXT_CONFIG["max_position_embeddings"], bos_token=BOS,
                                      eos_token=EOS, pad_token=PAD, unk_token=UNK)
    size = VISION_CONFIG["image_size"]
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=VISION_CONFIG["patch_size"], vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token=IMAGE, chat_template=CHAT_TEMPLATE)
    common.save_processor(processor, out, CHAT_TEMPLATE, pin={"image_processor": type(image_processor).__name__})

    special = dict(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config = LlavaConfig(
        vision_config=dict(VISION_CONFIG), text_config=dict(TEXT_CONFIG, vocab_size=common.VOCAB_SIZE, **special),
        image_token_index=ids[IMAGE], vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_seq_length=(size // VISION_CONFIG["patch_size"]) ** 2, projector_hidden_act="gelu",
        tie_word_embeddings=False, architectures=["LlavaForConditionalGeneration"], dtype="bfloat16", **special,
    )
    cfg = common.write_config(out, config)
    common.write_generation_config(out, cfg, **special)
    common.write_weights(
        LlavaForConditionalGeneration, config, out, common.derive_seed("llava", seed),
        rename={"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.vision_model.",
                "model.multi_modal_projector.": "multi_modal_projector.", "lm_head.": "language_model.lm_head."},
    )
