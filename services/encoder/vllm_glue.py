"""The encoder's reach into vLLM beyond its public API, in one place: what a model's multimodal
processor does that the service must know before it serves (each modality's placeholder, whether an
item's prompt layout depends on the prompt around it). Every private vLLM name used here is checked by
name in ``tests/unit/test_vllm_private_names.py``, so a vLLM upgrade that renames one fails there."""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm.model_executor.models.registry import ModelRegistry
from vllm.multimodal.processing.processor import BaseMultiModalProcessor

# Private to vLLM: the methods a family's processor overrides when it rewrites tokens around an item.
TOKEN_REWRITERS = ("_apply_token_matches", "_find_mm_placeholders")


MODALITIES = ("image", "audio", "video")
"""What an encoder encodes, where its model takes it."""


def placeholders(engine) -> dict[str, Callable[[int], str]]:
    """Per modality of ``MODALITIES`` the model takes (its limit per prompt above 0), its prompt
    placeholder for the i-th item (vLLM's ``get_placeholder_str``). An encoder-decoder model: audio, with
    no placeholder (the audio is its encoder's prompt; ``EncoderServicer`` builds vLLM's explicit
    encoder/decoder prompt for it)."""
    mc = engine.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    if mc.is_encoder_decoder:  # Whisper-class: its audio is the encoder's whole prompt (no placeholder)
        return {"audio": lambda i: ""}
    out = {}
    for modality in MODALITIES:
        try:
            ph = model_cls.get_placeholder_str(modality, 1)
        except ValueError:  # vLLM's way of saying the model has no such modality
            continue
        if ph and mc.multimodal_config.get_limit_per_prompt(modality) > 0:
            out[modality] = functools.partial(model_cls.get_placeholder_str, modality)
    if not out:
        raise ValueError(f"{mc.architectures} takes none of {', '.join(MODALITIES)}")
    return out


def layouts_context_free(engine) -> bool:
    """Whether an item's prompt layout depends on the item alone, so that the layout
    the encoder computes from a prompt of bare placeholders can be spliced into any
    LM prompt. False when the model's multimodal processor rewrites tokens around
    its replacements (vLLM's ``_apply_token_matches`` / ``_find_mm_placeholders``
    overridden: Gemma 3 merges the newlines it puts around each image with the
    prompt's own); its LMs then lay the prompt out with their processor."""
    mc = engine.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    proc = getattr(getattr(model_cls, "_processor_factory", None), "processor", None)
    if not isinstance(proc, type):
        return True
    return all(getattr(proc, name, None) is getattr(BaseMultiModalProcessor, name)
               for name in TOKEN_REWRITERS)
