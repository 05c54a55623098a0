"""Tiny random-weight Idefics3 (SmolVLM-style) checkpoints, in four sizes (``variant``).

Why this exists: the tests and the demo need a model with a *real* multimodal
architecture (SigLIP-style vision tower -> pixel-shuffle connector -> Llama
decoder) that vLLM serves and that transformers' ``AutoProcessor`` /
``AutoTokenizer`` / ``AutoConfig`` load, without downloading anything.  This
module writes such a directory from scratch: a byte-level BPE tokenizer trained
on generated text, an ``Idefics3Processor`` config, a model config and random
bfloat16 safetensors weights.  Output is byte-identical for the same
``variant`` and ``seed``.

Variants:

``tiny``      vision 2x64 (112 px, patch 14, pixel shuffle 2 -> 16 tokens per
              tile), Llama 2x128 (4 heads / 2 kv heads), vocab 2048; ~2 MB.
              ``size == max_image_size == 112``: every image (any size/aspect)
              is resized to one 112 px tile (no splitting), i.e. 16 ``<image>``
              tokens (19 placeholder tokens incl. ``<fake_token_around_image>``
              x2 and ``<global-img>``).
``tiny-alt``  like ``tiny`` but Llama hidden 96 (3 heads / 1 kv head) and
              different weights: a model that must not be mixed with ``tiny``.
``bench``     heavier vision tower (10x512, 384 px, patch 16, pixel shuffle 3
              -> 64 tokens per tile), Llama 4x256; ~77 MB.  Images are resized
              to longest edge 768 and split into 384 px tiles plus a global
              tile (a square or 3:2 image -> 2x2 tiles + global = 320 tokens).
``bench-light`` like ``bench`` (same LM, tiling and 320 image tokens) but a
              4x256 vision tower, about 9x less vision compute: one image costs
              about as many decode steps as a 7B VLM's image on a GPU does
              (``bench`` is ~8x too heavy for that; see docs/benchmarks.md).

Idefics3 always rescales the longest edge to ``size["longest_edge"]`` (also
upscaling), so the tile count depends on the aspect ratio, not on resolution.
"""

from __future__ import annotations

import json
import pathlib

from tools.tiny_families.common import corpus, derive_seed, dump_json

VOCAB_SIZE = 2048

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<end_of_utterance>",
    "<fake_token_around_image>", "<image>", "<global-img>",
] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
PAD, BOS, EOS, IMAGE = "<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>"

# SmolVLM/Idefics3 style; content may be a string or a list of typed parts.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'] and message['content'][0]['type'] in ('image', 'image_url') %}"
    "{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

VARIANTS: dict[str, dict] = {
    "tiny": dict(
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, image_size=112, patch_size=14),
        scale_factor=2,
        text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024),
        size=112, max_image_size=112,
    ),
    "tiny-alt": dict(
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, image_size=112, patch_size=14),
        scale_factor=2,
        text=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1,
                  max_position_embeddings=1024),
        size=112, max_image_size=112,
    ),
    "bench": dict(
        vision=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=10,
                    num_attention_heads=8, image_size=384, patch_size=16),
        scale_factor=3,
        text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048),
        size=768, max_image_size=384,
    ),
}
# ``bench`` with a 4x256 vision tower: same LM, tiling and 320 image tokens.
VARIANTS["bench-light"] = dict(VARIANTS["bench"], vision=dict(
    VARIANTS["bench"]["vision"], hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4))


def _image_seq_len(spec: dict) -> int:
    v = spec["vision"]
    return (v["image_size"] // v["patch_size"]) ** 2 // spec["scale_factor"] ** 2


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def _weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names/shapes of Idefics3ForConditionalGeneration (HF layout)."""
    v, t = cfg["vision_config"], cfg["text_config"]
    H, I, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]  # noqa: E741 - the config's sizes
    vp = "model.vision_model."
    s: dict[str, tuple[int, ...]] = {
        vp + "embeddings.patch_embedding.weight": (H, 3, p, p),
        vp + "embeddings.patch_embedding.bias": (H,),
        vp + "embeddings.position_embedding.weight": ((v["image_size"] // p) ** 2, H),
        vp + "post_layernorm.weight": (H,), vp + "post_layernorm.bias": (H,),
    }
    for i in range(v["num_hidden_layers"]):
        lp = f"{vp}encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[f"{lp}self_attn.{n}.weight"], s[f"{lp}self_attn.{n}.bias"] = (H, H), (H,)
        for n in ("layer_norm1", "layer_norm2"):
            s[f"{lp}{n}.weight"], s[f"{lp}{n}.bias"] = (H,), (H,)
        s[lp + "mlp.fc1.weight"], s[lp + "mlp.fc1.bias"] = (I, H), (I,)
        s[lp + "mlp.fc2.weight"], s[lp + "mlp.fc2.bias"] = (H, I), (H,)
    D, TI, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    hd = D // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    s["model.connector.modality_projection.proj.weight"] = (D, H * cfg["scale_factor"] ** 2)
    tp = "model.text_model."
    s[tp + "embed_tokens.weight"], s[tp + "norm.weight"] = (V, D), (D,)
    for i in range(t["num_hidden_layers"]):
        lp = f"{tp}layers.{i}."
        s.update({
            lp + "self_attn.q_proj.weight": (q, D), lp + "self_attn.k_proj.weight": (kv, D),
            lp + "self_attn.v_proj.weight": (kv, D), lp + "self_attn.o_proj.weight": (D, q),
            lp + "mlp.gate_proj.weight": (TI, D), lp + "mlp.up_proj.weight": (TI, D),
            lp + "mlp.down_proj.weight": (D, TI),
            lp + "input_layernorm.weight": (D,), lp + "post_attention_layernorm.weight": (D,),
        })
    s["lm_head.weight"] = (V, D)
    return s


def _write_weights(cfg: dict, out: pathlib.Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    # A local generator (like torch.manual_seed, but leaves the global RNG alone).
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_weight_shapes(cfg).items()):
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            w = torch.ones(shape)  # LayerNorm / RMSNorm scales
        elif name.endswith(".bias"):
            w = torch.zeros(shape)
        else:
            w = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        tensors[name] = w.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def build(out: pathlib.Path, seed: int, variant: str = "tiny") -> None:
    """Write the ``variant`` (:data:`VARIANTS`) checkpoint into the (empty) folder ``out``."""
    from transformers import Idefics3Config, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.utils import logging as hf_logging

    spec = VARIANTS[variant]
    seq_len = _image_seq_len(spec)
    raw_tok = _train_tokenizer()
    ids = {t: raw_tok.token_to_id(t) for t in (PAD, BOS, EOS, IMAGE)}

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=spec["text"]["max_position_embeddings"], chat_template=CHAT_TEMPLATE,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": spec["size"]}, max_image_size={"longest_edge": spec["max_image_size"]},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len,
        chat_template=CHAT_TEMPLATE,
    )
    # processor_config.json, chat_template.jinja, tokenizer.json, tokenizer_config.json
    processor.save_pretrained(str(out))
    # Pin the PIL backend: identical preprocessing with or without torchvision
    # (transformers records the backend-neutral name, which warns without it).
    proc_cfg = json.loads((out / "processor_config.json").read_text(encoding="utf-8"))
    proc_cfg["image_processor"]["image_processor_type"] = type(image_processor).__name__
    dump_json(proc_cfg, out / "processor_config.json")
    # Re-save the tokenizer with the template inline in tokenizer_config.json as well.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    dump_json({"chat_template": CHAT_TEMPLATE}, out / "chat_template.json")

    special = dict(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    text_cfg = dict(model_type="llama", vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
                    rms_norm_eps=1e-5, **spec["text"], **special)
    config = Idefics3Config(
        vision_config=dict(spec["vision"]), text_config=text_cfg,
        scale_factor=spec["scale_factor"], image_token_id=ids[IMAGE],
        tie_word_embeddings=False, architectures=["Idefics3ForConditionalGeneration"],
        dtype="bfloat16", **special,
    )
    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # to_diff_dict warns about its own default config
    try:
        cfg = config.to_diff_dict()
    finally:
        hf_logging.set_verbosity(prev)
    cfg["torch_dtype"] = "bfloat16"  # older readers
    dump_json(cfg, out / "config.json")
    dump_json(dict(special, transformers_version=cfg.get("transformers_version")),
               out / "generation_config.json")
    # A stable torch seed per (variant, seed), so variants never share weights.
    _write_weights(config.to_dict(), out, derive_seed(variant, seed))
