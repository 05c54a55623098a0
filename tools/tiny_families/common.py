"""Pieces every tiny family builder shares: tokenizer, weights, JSON files.

Called by the family modules beside this one, in the process that runs
``build_tiny_model``; everything is written into the caller's staging folder
(``out``), which ``tools.tiny_model`` moves into place.  Deterministic: the
same family and seed give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random

# Shared with the Idefics3 builder (tools/tiny_families/idefics3.py), so prompts tokenize alike.
CORPUS_SEED = 1234
VOCAB_SIZE = 2048

_ENGLISH = (
    "the a an of to and in is it that this what which who where when why how "
    "image picture photo describe show see look color red green blue black "
    "white yellow cat dog car house tree sky water person people man woman "
    "small large big little left right top bottom center there here are was "
    "be has have with on at for from by as not no yes can do does please "
    "tell me about you your answer question user assistant text number one "
    "two three four five six seven eight nine ten hello world test demo"
).split()


def corpus() -> list[str]:
    """Generated training text: pseudo-words, English words, punctuation."""
    rng = random.Random(CORPUS_SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    words += _ENGLISH * 20
    punct = [".", ",", "?", "!", ":", "\n", " -", " 42", " 7", " 2024"]
    lines = []
    for _ in range(2000):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))
        lines.append(line.capitalize() + rng.choice(punct))
    return lines


def train_tokenizer(special_tokens: list[str], plain_tokens: tuple[str, ...] = (), vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` (:data:`VOCAB_SIZE`) tokens.

    ``special_tokens`` get the first ids, in order.  ``plain_tokens`` are added
    last as non-special added tokens matched before BPE (Gemma 3 keeps newline
    runs such as ``"\\n\\n"`` as single vocabulary entries, and vLLM looks them up).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(plain_tokens), special_tokens=special_tokens, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain_tokens])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def dump_json(obj: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def config_dict(config) -> dict:
    """``config.to_diff_dict()`` without transformers' warning about its own defaults."""
    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return config.to_diff_dict()
    finally:
        hf_logging.set_verbosity(prev)


def save_processor(processor, out: pathlib.Path, chat_template: str, pin: dict[str, str]) -> None:
    """Save processor, tokenizer and chat template the way hub checkpoints ship them.

    ``pin`` maps a sub-processor key of ``processor_config.json`` (``image_processor``)
    to the class name to record: the PIL one, which loads without torchvision and
    without a fallback warning.  (transformers 5 still picks its torchvision
    backend of the same processor when torchvision is installed.)
    """
    processor.save_pretrained(str(out))
    path = out / "processor_config.json"
    if path.exists() and pin:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        for key, cls in pin.items():
            cfg[key]["image_processor_type"] = cls
        dump_json(cfg, path)
    processor.tokenizer.save_pretrained(str(out), save_jinja_files=False)
    dump_json({"chat_template": chat_template}, out / "chat_template.json")


def _is_norm(module: str) -> bool:
    return "norm" in module or module.startswith("ln")


def write_weights(model_cls, config, out: pathlib.Path, seed: int, rename: dict[str, str],
                  zero_norms: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Write random bfloat16 weights for ``model_cls(config)`` to ``model.safetensors``.

    Names and shapes come from the transformers model built on the meta device
    (no memory, no init); names are then renamed by prefix (``rename``, first
    match wins) into the layout hub checkpoints use, which vLLM's loaders read.
    Norm scales are 1 (0 for names starting with a ``zero_norms`` prefix:
    Gemma's RMSNorm multiplies by ``1 + w``), biases 0, everything else
    N(0, 0.02) from a local generator.  Names starting with a ``skip`` prefix
    (tied heads) are left out.  Returns the written names and shapes.
    """
    import torch
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = model_cls(config)
    shapes = {}
    for name, t in model.state_dict().items():
        if name.startswith(skip):
            continue
        for old, new in rename.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        shapes[name] = tuple(t.shape)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        parts = name.rsplit(".", 2)
        module = parts[-2] if len(parts) > 1 else ""
        if _is_norm(module) and name.endswith(".weight"):
            w = torch.zeros(shape) if name.startswith(zero_norms) else torch.ones(shape)
        elif name.endswith(".bias"):
            w = torch.zeros(shape)
        else:
            w = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        tensors[name] = w.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return shapes


def derive_seed(tag: str, seed: int) -> int:
    """A stable torch seed per (family, seed), so families never share weights."""
    digest = hashlib.sha256(f"{tag}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def tokenizer_fast(raw_tok, chat_template: str, max_len: int, **special):
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=raw_tok, model_max_length=max_len,
                                   chat_template=chat_template, **special)


def write_generation_config(out: pathlib.Path, cfg: dict, **ids) -> None:
    dump_json(dict(ids, transformers_version=cfg.get("transformers_version")), out / "generation_config.json")


def write_config(out: pathlib.Path, config) -> dict:
    """``config.json`` as hub checkpoints have it; returns the written dict."""
    cfg = config_dict(config)
    cfg["torch_dtype"] = "bfloat16"  # older readers
    dump_json(cfg, out / "config.json")
    return cfg
