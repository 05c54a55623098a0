"""Tiny random-weight checkpoints of the multimodal families vLLM serves, built offline.

One module per family; each has ``build(out, seed)``, which writes a complete
checkpoint directory (config, tokenizer, processor, chat template, weights in
the hub layout) into ``out``.  ``tools.tiny_model.build_tiny_model`` is the
entry point: it stages, marks and moves the directory into place.

Families (see docs/models.md for sizes and what is verified):

``idefics3``     SigLIP-style ViT -> pixel-shuffle connector -> Llama LM (SmolVLM-style), the
                 default model; the one family with more than one size (``idefics3.VARIANTS``: the
                 benchmarks' ``bench`` and ``bench-light``), ``build(out, seed, variant)``.
``qwen2_audio``  Whisper-style audio encoder -> linear projector -> Qwen2 LM.
``qwen2_5_vl``   window-attention ViT with 2x2 patch merger -> Qwen2 LM with M-RoPE.
``qwen3_vl``     ViT with 2x2 patch merger + DeepStack merger -> Qwen3 LM with interleaved M-RoPE.
``gemma3``       SigLIP -> avg-pool + soft-emb norm projector -> Gemma 3 LM.
``llava``        CLIP ViT -> 2-layer MLP projector -> Llama LM (LLaVA-1.5 layout).
``whisper``      Whisper encoder -> cross-attention of a Whisper decoder (encoder-decoder;
                 speech to text only: vLLM's transcription/translation routes, no chat template).
"""

from __future__ import annotations

import importlib
import pathlib

FAMILIES = ("idefics3", "qwen2_audio", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "whisper")


def variants(family: str) -> tuple[str, ...]:
    """The sizes ``family`` is built in: Idefics3's ``VARIANTS``; every other family has one, ``tiny``."""
    if family == "idefics3":
        from tools.tiny_families.idefics3 import VARIANTS

        return tuple(VARIANTS)
    return ("tiny",)


def check(family: str, variant: str) -> None:
    """Raises ValueError, naming the choices, unless ``family`` is built in size ``variant``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    if variant not in variants(family):
        raise ValueError(f"unknown variant {variant!r} for {family}; choose from {sorted(variants(family))}")


def build_family(family: str, out: pathlib.Path, seed: int, variant: str = "tiny") -> None:
    """Write the ``family`` checkpoint (of size ``variant``) into the (empty) folder ``out``."""
    check(family, variant)
    module = importlib.import_module(f"{__name__}.{family}")
    if family == "idefics3":
        module.build(out, seed, variant)
    else:
        module.build(out, seed)
