"""A model directory's identity, cheaply: what the compatibility hash
(``ectransfer.protocol.make_compat``) compares between an encoder and an LM.

Two directories are the same model when these agree:

- the small files that shape inputs and outputs, read whole: ``config.json``,
  the processor's and tokenizer's files (``TEXT_FILES``) and the shard index
  ``model.safetensors.index.json``;
- every ``*.safetensors`` file's name, size and header (the JSON that lists
  each tensor's name, dtype, shape and byte range), plus one 4 KiB sample from
  the middle of each tensor's bytes;
- other weight files (``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): name, size
  and their first and last 64 KiB.

The weights are never read in full (minutes for a large model, at every start);
the samples are a few KB per tensor. A header alone would miss a fine-tune, which
keeps every shape and offset: the per-tensor samples catch any fine-tune that
changes a tensor throughout (a full fine-tune, a merged LoRA). Changes confined to
a few rows of one tensor away from its middle (e.g. only the embeddings of added
tokens) can go unnoticed; such a model normally changes its tokenizer files too.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

TEXT_FILES = (
    "config.json", "model.safetensors.index.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
)
"""Read whole (all are small): they define the architecture, the inputs the processor makes and the
token ids around each item."""
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.gguf")
SAMPLE_NBYTES = 4096
"""Bytes sampled from the middle of each safetensors tensor."""
EDGE_NBYTES = 64 << 10
"""Bytes read from each end of a weight file in another format."""
MAX_HEADER_NBYTES = 100 << 20  # safetensors' own limit


def model_fingerprint(model: str) -> str:
    """A sha256 hex digest of ``model``'s identity when it is a local directory
    (see the module docstring), else the name itself (a hub name: the same
    name on both ends is all we can compare)."""
    if not os.path.isdir(model):
        return model
    h = hashlib.sha256()
    for name in TEXT_FILES:
        path = os.path.join(model, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                _feed(h, name, hashlib.sha256(f.read()).digest())
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        _feed(h, os.path.basename(path), _safetensors_identity(path))
    for pattern in OTHER_WEIGHTS:
        for path in sorted(glob.glob(os.path.join(model, pattern))):
            _feed(h, os.path.basename(path), _edges_identity(path))
    return h.hexdigest()


def _feed(h, name: str, digest: bytes) -> None:
    h.update(name.encode() + b"\0" + digest)


def _safetensors_identity(path: str) -> bytes:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return _edges_identity(path)
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_NBYTES, size - 8):
            return _edges_identity(path)  # not a safetensors file after all: still compared, by its ends
        header = f.read(n)
        h.update(header)
        try:
            tensors = json.loads(header)
        except ValueError:
            return _edges_identity(path)
        start = 8 + n
        for key in sorted(k for k in tensors if k != "__metadata__"):
            begin, end = tensors[key].get("data_offsets", (0, 0))
            mid = start + begin + max(0, (end - begin - SAMPLE_NBYTES) // 2)
            f.seek(mid)
            h.update(f.read(min(SAMPLE_NBYTES, end - begin)))
    return h.digest()


def _edges_identity(path: str) -> bytes:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(EDGE_NBYTES))
        f.seek(max(0, size - EDGE_NBYTES))
        h.update(f.read(EDGE_NBYTES))
    return h.digest()
