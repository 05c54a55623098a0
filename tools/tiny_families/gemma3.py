"""Tiny Gemma 3: SigLIP (2x64, 112 px, patch 14) -> 2x2 avg-pool + soft-emb norm -> Gemma 3 LM (2x128).

Every image is resized to 112x112 (no pan-and-scan) and costs 16
``<image_soft_token>`` tokens, wrapped as ``"\\n\\n<start_of_image>...<end_of_image>\\n\\n"``.
The tokenizer keeps newline runs as single tokens, as Gemma's does (vLLM's
Gemma 3 processor looks up ``"\\n"`` to ``"\\n\\n\\n\\n"``).  The LM has one
sliding-window and one full-attention layer, and ties its head to the embeddings.
"""

from __future__ import annotations

import pathlib

from tools.tiny_families import common

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
           "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
NEWLINES = tuple("\n" * n for n in range(1, 9))
PAD, EOS, BOS, UNK, END_TURN = "<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

# Gemma 3 instruct's template; parts are matched by their ``type``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'][0]['text']) + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first_user_prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

VISION_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     image_size=112, patch_size=14, vision_use_head=False, layer_norm_eps=1e-6)
TEXT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                   layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048)
MM_TOKENS_PER_IMAGE = 16  # (112 / 14)^2 patches, pooled 2x2


def build(out: pathlib.Path, seed: int) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    raw = common.train_tokenizer(SPECIAL, plain_tokens=NEWLINES)
    ids = {t: raw.token_to_id(t) for t in (PAD, EOS, BOS, END_TURN, BOI, EOI, IMAGE)}
    tokenizer = common.tokenizer_fast(
        raw, CHAT_TEMPLATE, TEXT_CONFIG["max_position_embeddings"], bos_token=BOS, eos_token=EOS,
        pad_token=PAD, unk_token=UNK, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
    )
    size = VISION_CONFIG["image_size"]
    image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size}, do_pan_and_scan=False,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=MM_TOKENS_PER_IMAGE, chat_template=CHAT_TEMPLATE)
    common.save_processor(processor, out, CHAT_TEMPLATE, pin={"image_processor": type(image_processor).__name__})

    special = dict(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config = Gemma3Config(
        vision_config=dict(VISION_CONFIG), text_config=dict(TEXT_CONFIG, vocab_size=common.VOCAB_SIZE, **special),
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE, boi_token_index=ids[BOI], eoi_token_index=ids[EOI],
        image_token_index=ids[IMAGE], tie_word_embeddings=True,
        architectures=["Gemma3ForConditionalGeneration"], dtype="bfloat16", **special,
    )
    cfg = common.write_config(out, config)
    # Instruct checkpoints stop at either <eos> or <end_of_turn>.
    common.write_generation_config(out, cfg, bos_token_id=ids[BOS], pad_token_id=ids[PAD],
                                   eos_token_id=[ids[EOS], ids[END_TURN]])
    common.write_weights(
        Gemma3ForConditionalGeneration, config, out, common.derive_seed("gemma3", seed),
        rename={"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.vision_model.",
                "model.multi_modal_projector.": "multi_modal_projector."},
        zero_norms=("language_model.", "multi_modal_projector.mm_soft_emb_norm"), skip=("lm_head.",),
    )
