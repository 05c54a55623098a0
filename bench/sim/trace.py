"""Request traces for the fleet model, generated with numpy from a seed.

A trace is a ``Trace`` of parallel arrays, one row per request, sorted by arrival: arrival time (s),
text prompt tokens, images and tokens per image (every image of a request has the same size), output
tokens. The caller owns the arrays; the simulator only reads them.

- ``capacity_trace``: the capacity benchmark's workloads (``bench/capacity.py``) as ``vllm bench
  serve`` sends them: Poisson arrivals at a rate (the first at 0), ``random-mm`` (one image a request)
  or ``mixed`` (every 10th request an image, the others a one-sentence text), fixed output length.
- ``day_trace``: a day compressed into ``hours * hour_s`` seconds: a diurnal rate with bursts on top,
  and an image share that moves from ``share_lo`` to ``share_hi`` and back over the day.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    t: np.ndarray
    prompt: np.ndarray
    n_img: np.ndarray
    img_tok: np.ndarray
    out: np.ndarray

    def __len__(self) -> int:
        return len(self.t)

    @property
    def duration(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0


def capacity_trace(workload: str, rate: float, n: int, seed: int, *, image_tokens: int, text_tokens: int,
                   mixed_text_tokens: int, out_tokens: int, image_every: int = 10) -> Trace:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    t = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    if workload == "random-mm":
        n_img = np.ones(n, dtype=np.int64)
        prompt = np.full(n, text_tokens, dtype=np.int64)
    elif workload == "mixed":
        n_img = (np.arange(n) % image_every == image_every - 1).astype(np.int64)
        prompt = np.full(n, mixed_text_tokens, dtype=np.int64)
    else:
        raise ValueError(f"workload {workload!r}; allowed: random-mm, mixed")
    return Trace(t, prompt, n_img, np.full(n, image_tokens, dtype=np.int64), np.full(n, out_tokens, dtype=np.int64))


def rate_at(hour: np.ndarray, cfg: dict) -> np.ndarray:
    """Offered requests/s at an hour of the day, before bursts: lowest at ``rate_low_hour``."""
    swing = np.sin(np.pi * (hour - cfg["rate_low_hour"]) / 24.0) ** 2
    return cfg["rate_mean"] * (cfg["rate_floor"] + (1.0 - cfg["rate_floor"]) * swing) / _mean_shape(cfg)


def _mean_shape(cfg: dict) -> float:
    return cfg["rate_floor"] + (1.0 - cfg["rate_floor"]) * 0.5  # mean of sin^2 over a day


def share_at(hour: np.ndarray, cfg: dict) -> np.ndarray:
    """Image share at an hour of the day: ``share_lo`` at midnight, ``share_hi`` at noon."""
    return cfg["share_lo"] + (cfg["share_hi"] - cfg["share_lo"]) * np.sin(np.pi * hour / 24.0) ** 2


def burst_factor(t: np.ndarray, starts: np.ndarray, cfg: dict) -> np.ndarray:
    """``burst_x`` while ``t`` is inside a burst (``burst_s`` long from each start), else 1."""
    idx = np.searchsorted(starts, t, side="right") - 1
    inside = (idx >= 0) & (t - starts[np.maximum(idx, 0)] < cfg["burst_s"])
    return np.where(inside, cfg["burst_x"], 1.0)


def day_trace(cfg: dict, seed: int, scale: float = 1.0) -> Trace:
    """The day (``cfg`` is the inputs file's ``day`` section); ``scale`` multiplies the rate (a smaller
    fleet gets a proportionally smaller day). Arrivals are a thinned Poisson process."""
    rng = np.random.default_rng(seed)
    length = cfg["hours"] * cfg["hour_s"]
    n_bursts = rng.poisson(length / cfg["burst_gap_s"])
    starts = np.sort(rng.uniform(0.0, length, n_bursts))
    peak = float(rate_at(np.array([cfg["rate_low_hour"] + 12.0]), cfg)[0]) * cfg["burst_x"] * scale
    n = rng.poisson(peak * length)
    t = np.sort(rng.uniform(0.0, length, n))
    hour = t / cfg["hour_s"]
    keep = rng.random(n) * peak < rate_at(hour, cfg) * burst_factor(t, starts, cfg) * scale
    t, hour = t[keep], hour[keep]
    m = len(t)
    is_img = rng.random(m) < share_at(hour, cfg)
    n_img = np.where(is_img, rng.choice(cfg["images_per_request"], m, p=cfg["images_per_request_p"]), 0)
    img_tok = rng.choice(cfg["image_tokens"], m, p=cfg["image_tokens_p"])
    prompt = np.clip(rng.lognormal(np.log(cfg["prompt_median"]), cfg["prompt_sigma"], m), 16, cfg["prompt_max"])
    out = np.clip(rng.lognormal(np.log(cfg["out_median"]), cfg["out_sigma"], m), 8, cfg["out_max"])
    return Trace(t, prompt.astype(np.int64), n_img.astype(np.int64), img_tok.astype(np.int64), out.astype(np.int64))
