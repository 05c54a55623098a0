"""Per-stage costs of the simulated fleet, one dataclass per stage, read from ``bench/sim_inputs.json``.

The inputs file holds named profiles (the two 2-core CPU hosts the capacity runs used, one H100 for a
7B-class VLM). Each figure there is ``{"value": ..., "source": "..."}``; ``load_profile`` keeps the
values and drops the sources (the JSON is where a reader checks them). Times are seconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

INPUTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sim_inputs.json")


@dataclass(frozen=True)
class EncoderCost:
    """One encoder instance: a batch of up to ``max_batch`` items takes
    ``fixed_s + per_item_s * items + per_token_s * tokens``."""

    fixed_s: float = 0.0
    per_item_s: float = 0.0
    per_token_s: float = 0.0
    max_batch: int = 8

    def batch_s(self, n_items: int, n_tokens: int) -> float:
        return self.fixed_s + self.per_item_s * n_items + self.per_token_s * n_tokens


@dataclass(frozen=True)
class LMCost:
    """One LM instance with continuous batching: a step takes ``step_s + per_seq_s * decoding +
    per_prefill_token_s * prefill tokens`` (plus, colocated, the in-step encode of the images that
    start prefill in it: ``colo_per_item_s + colo_per_token_s * tokens`` each). A step prefills at most
    ``chunk_tokens``; at most ``max_seqs`` requests hold KV, and their prompts plus outputs at most
    ``kv_tokens`` (reserved in full at admission: vLLM allocates as it goes and may preempt; reserving
    is the conservative side)."""

    step_s: float = 0.005
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0
    chunk_tokens: int = 2048
    max_seqs: int = 8
    kv_tokens: int = 1 << 30
    colo_per_item_s: float = 0.0
    colo_per_token_s: float = 0.0

    def colo_encode_s(self, n_items: int, n_tokens: int) -> float:
        return self.colo_per_item_s * n_items + self.colo_per_token_s * n_tokens


@dataclass(frozen=True)
class PathCost:
    """What a request pays outside the engines: ``front_s`` before its first token on every path (the
    gateway, the LM's frontend, the client), ``meta_s`` before an image request's items reach the
    encoders (the metadata round trip) and ``preprocess_s`` per image before it is encoded (host-side
    decode and resize, on the encoder's host or colocated vLLM's frontend), and per item landed
    ``transfer_fixed_s + tokens * bytes_per_token / transfer_bps``."""

    front_s: float = 0.0
    meta_s: float = 0.0
    preprocess_s: float = 0.0
    transfer_fixed_s: float = 0.0
    bytes_per_token: float = 0.0
    transfer_bps: float = 1e9

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_fixed_s + tokens * self.bytes_per_token / self.transfer_bps


@dataclass(frozen=True)
class Profile:
    name: str
    encoder: EncoderCost
    lm: LMCost
    path: PathCost


def _values(section: dict, cls) -> dict:
    names = {f.name for f in fields(cls)}
    out = {}
    for key, entry in section.items():
        if key not in names:
            raise ValueError(f"{cls.__name__} has no field {key!r}; allowed: {sorted(names)}")
        out[key] = entry["value"] if isinstance(entry, dict) else entry
    return out


def load_profile(name: str, path: str = INPUTS) -> Profile:
    """The named profile of the inputs file (``ValueError`` listing the names if it is not there)."""
    with open(path) as f:
        data = json.load(f)["profiles"]
    if name not in data:
        raise ValueError(f"no profile {name!r} in {path}; allowed: {sorted(data)}")
    p = data[name]
    return Profile(name, EncoderCost(**_values(p["encoder"], EncoderCost)), LMCost(**_values(p["lm"], LMCost)),
                   PathCost(**_values(p["path"], PathCost)))


def load_section(key: str, path: str = INPUTS) -> dict:
    """A non-profile section of the inputs file (the day trace, the objectives), sources dropped."""
    with open(path) as f:
        sec = json.load(f)[key]
    return {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in sec.items()}
