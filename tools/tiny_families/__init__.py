"""Tiny random-weight checkpoints of the multimodal families vLLM serves, built offline.

One module per family; each has ``build(out, seed)``, which writes a complete
checkpoint directory (config, tokenizer, processor, chat template, weights in
the hub layout) into ``out``.  ``tools.tiny_model.build_tiny_model`` is the
entry point: it stages, marks and moves the directory into place.  Idefics3
stays in ``tools/tiny_model.py`` (its variants feed the benchmarks).

Families (see docs/models.md for sizes and what is verified):

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

FAMILIES = ("qwen2_audio", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "whisper")


def build_family(family: str, out: pathlib.Path, seed: int) -> None:
    """Write the ``family`` checkpoint into the (empty) folder ``out``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    importlib.import_module(f"{__name__}.{family}").build(out, seed)
