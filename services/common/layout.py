"""Prompt layout from the encoder's metadata: the LM never runs the image processor.

A multimodal processor turns each image's placeholder in the prompt (for
Idefics3 the ``<image>`` token) into the tokens the model reads for it (tiles,
row/column markers, one token per embedding row) and records where the
embeddings go (vLLM's ``PlaceholderRange``: offset, length and an ``is_embed``
mask). That expansion depends on the image only, never on the text around it:
vLLM itself applies it by token-id replacement on the tokenized text (its
processor-cache path does exactly this). So the encoder, which runs the
processor anyway, sends each item's expansion with its metadata
(:func:`item_layouts`), and the LM splices it into its own tokenized prompt
(:func:`splice`). The result is the token list and placeholder ranges that
vLLM's processor would have made, bit for bit (tests compare them), without
decoding, resizing or normalising the image a second time.

Functions on lists, bytes and (for vLLM's masks) torch tensors; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ItemLayout:
    """One item's expansion: ``tokens`` replace ``placeholder`` in the prompt;
    ``is_embed`` marks (one byte per token, 1 = an embedding row) which of them
    take the encoder's rows; empty: all of them."""

    placeholder: tuple[int, ...]
    tokens: tuple[int, ...]
    is_embed: bytes = b""

    @property
    def num_embeds(self) -> int:
        return len(self.tokens) if not self.is_embed else sum(1 for b in self.is_embed if b)


def placeholder_ranges(features) -> list[tuple[int, int, bytes]]:
    """vLLM ``MultiModalFeatureSpec``s (their ``mm_position``) as the
    (offset, length, is_embed bytes) that :func:`item_layouts` takes."""
    return [(f.mm_position.offset, f.mm_position.length, mask_bytes(f.mm_position.is_embed)) for f in features]


def mask_bytes(is_embed) -> bytes:
    """A ``PlaceholderRange.is_embed`` bool tensor as one byte per token; None: empty."""
    return b"" if is_embed is None else is_embed.to(torch.uint8).numpy().tobytes()


def item_layouts(original: Sequence[int], processed: Sequence[int],
                 ranges: Sequence[tuple[int, int, bytes]]) -> list[ItemLayout] | None:
    """Each item's layout from the encoder's own processing of ``n`` placeholders.

    ``original``: the encoder prompt (the placeholder string ``n`` times)
    tokenized as vLLM tokenizes it; ``processed``: vLLM's prompt token ids
    after the processor; ``ranges``: per item (in prompt order) its
    placeholder range as (offset, length, is_embed bytes). The processor
    replaced the same token run ``T`` of every placeholder with each item's
    range and kept every other token, so ``len(original) - n*len(T) ==
    len(processed) - sum(lengths)`` gives ``T``. None when the numbers do not
    fit that picture (a processor that inserts instead of replacing): the LM
    then lays the prompt out with its own processor.
    """
    n = len(ranges)
    if n == 0:
        return []
    total = sum(length for _, length, _ in ranges)
    t, rem = divmod(len(original) - len(processed) + total, n)
    if rem or t <= 0:
        return None
    first = ranges[0][0]
    placeholder = tuple(original[first:first + t])
    # Check the picture: the kept tokens between the ranges are the original's.
    kept_p, kept_o, pos_p, pos_o = [], [], 0, 0
    for offset, length, _ in ranges:
        if offset < pos_p:
            return None
        kept_p += processed[pos_p:offset]
        gap = offset - pos_p
        kept_o += original[pos_o:pos_o + gap]
        if tuple(original[pos_o + gap:pos_o + gap + t]) != placeholder:
            return None
        pos_p, pos_o = offset + length, pos_o + gap + t
    kept_p += processed[pos_p:]
    kept_o += original[pos_o:]
    if kept_p != kept_o:
        return None
    return [ItemLayout(placeholder, tuple(processed[off:off + length]), bytes(mask))
            for off, length, mask in ranges]


class LayoutError(ValueError):
    """The prompt and the items do not fit (wrong number of placeholders)."""


def splice(prompt: Sequence[int], items: Sequence[ItemLayout]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt with each item's placeholder (left to right, in item order)
    replaced by its tokens, and each item's (offset, length) in the result."""
    out, positions = splice_modalities(prompt, {"image": items})
    return out, positions["image"]


def splice_modalities(prompt: Sequence[int], items: dict[str, Sequence[ItemLayout]]
                      ) -> tuple[list[int], dict[str, list[tuple[int, int]]]]:
    """``splice`` for a prompt with items of several modalities (``items``: per modality, its items
    in prompt order, as vLLM lists them). Returns the spliced prompt and per modality each item's
    (offset, length) in it.

    vLLM's rule (``vllm/multimodal/processing/processor.py``: ``_plan_prompt_updates_with``, which
    ``apply_token_matches`` runs): left to right, the earliest placeholder of a modality that still has
    items takes that modality's next item; once a modality's items are placed, its placeholder is
    ordinary text (a client's literal ``<image>`` beside one image is kept as a token, not refused).
    Each modality's placeholder is its own token run, so at every position at most one modality's
    placeholder matches. LayoutError when the prompt has fewer placeholders than items (vLLM:
    ``_validate_mm_placeholders``); tests/unit/test_layout.py checks the rule against vLLM's own."""
    out: list[int] = []
    positions: dict[str, list[tuple[int, int]]] = {m: [] for m in items}
    i = 0
    while i < len(prompt):
        for modality, its in items.items():
            k = len(positions[modality])
            ph = its[k].placeholder if k < len(its) else ()
            if ph and tuple(prompt[i:i + len(ph)]) == ph:
                positions[modality].append((len(out), len(its[k].tokens)))
                out += its[k].tokens
                i += len(ph)
                break
        else:
            out.append(prompt[i])
            i += 1
    for modality, its in items.items():
        if len(positions[modality]) != len(its):
            raise LayoutError(f"the prompt has {len(positions[modality])} {modality} placeholder(s) for "
                              f"{len(its)} {modality} item(s)")
    return out, positions
