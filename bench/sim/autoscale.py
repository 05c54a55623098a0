"""The autoscaler's policy, in the simulator: the same idea as the local autoscaler
(``services/autoscale/``), on the signals the services export (``services/encoder/signals.py``,
``services/lm/signals.py``, vLLM's own series, the gateway's stage histograms).

Every ``tick_s`` it reads, over the active instances of each role:

- encoders: the busy share since the last tick (``epd_encoder_busy_seconds_total``'s rate), the
  items queued or running per encoder (``epd_encoder_queue_depth``), and the mean time an item waited
  before its batch started (the gateway's ``encode`` stage less the encoder's own time);
- LMs: requests held per LM (running and waiting: ``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting``) as a share of ``max_seqs``, the requests not yet started per LM
  (``vllm:num_requests_waiting``), and the mean time a request waited before its first prefill chunk
  (``vllm:request_queue_time_seconds``).

Each signal is smoothed (an exponential average, ``smooth``). A role is *hot* when its waits (time
queued, or the queue per instance) pass their high thresholds: its pressure, the larger of the two
ratios, is >= 1 (capped at ``pressure_cap`` for sizing). It has *room* when its utilisation (busy
share, or load) would stay below its high threshold with ``k`` fewer instances and its pressure is
under ``room``; it is *cold* when its utilisation is under the low threshold too.

- A hot role grows while the budget has room: ``ceil(n * (pressure - 1))`` instances (at least one,
  at most ``max_step``).
- At the budget, a hot role takes up to ``max_step`` GPUs from the other role, as many as leave that
  role room (drained, then started in the hot role).
- Above the floor (``min_gpus``), with no role hot, a cold role gives one GPU back. With
  ``min_gpus == budget`` (the comparison at equal GPU-hours) the policy only moves GPUs.

Hysteresis is the gap between the thresholds (a role is hot on waits, gives GPUs away only on low
utilisation and no wait). After an action the policy waits ``cooldown_s`` and until that action has
landed (no instance provisioning, no GPU still draining for an instance that waits for it), so one
shortage is not answered twice. A new instance joins after the fleet's ``provision_s``; a drained one
finishes what it holds, and its GPU is counted (and paid) until then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleConfig:
    tick_s: float = 1.0
    """Seconds between decisions (and between samples of the timeline)."""
    budget: int = 128
    """Most GPUs held at once (active, provisioning and draining)."""
    min_gpus: int = 128
    """Fewest GPUs held: with ``min_gpus == budget`` the policy only moves GPUs between roles."""
    cooldown_s: float = 4.0
    """Seconds after an action before the next."""
    max_step: int = 2
    """Most instances added or drained in one action."""
    smooth: float = 0.3
    """Weight of the newest sample in the exponential average of each signal."""
    enc_wait_hi: float = 0.5
    """Seconds an item waits for its batch that make the encoders hot (a quarter of a 2 s TTFT)."""
    enc_queue_hi: float = 16.0
    """Items queued or running per encoder that make the encoders hot whatever the wait: a full batch."""
    enc_busy_hi: float = 0.85
    enc_busy_lo: float = 0.5
    lm_wait_hi: float = 0.5
    """Seconds a request waits for its first prefill chunk that make the LMs hot (a quarter of a 2 s
    TTFT; a busy LM's prefill step alone is up to 0.4 s)."""
    lm_waiting_hi: float = 8.0
    """Requests not yet started per LM that make the LMs hot whatever the wait."""
    lm_load_hi: float = 0.6
    lm_load_lo: float = 0.3
    room: float = 0.5
    """Pressure under which a role can give GPUs away (half its hot thresholds)."""
    pressure_cap: float = 2.0
    """The most either role's pressure counts for when sizing a step."""

    def __post_init__(self):
        if not 0 < self.min_gpus <= self.budget:
            raise ValueError("need 0 < min_gpus <= budget")
        if not (self.enc_busy_lo < self.enc_busy_hi and self.lm_load_lo < self.lm_load_hi):
            raise ValueError("each low threshold must be below its high one")


class Autoscaler:
    """One per simulation run (it keeps the smoothed signals and the last action's time)."""

    def __init__(self, cfg: AutoscaleConfig):
        self.cfg = cfg
        self.tick_s = cfg.tick_s
        self.last_action = -math.inf
        self.busy_seen: dict[int, float] = {}
        self.waits_seen = {"encoder": (0.0, 0), "lm": (0.0, 0)}
        self.t_seen = 0.0
        self.sig = {k: 0.0 for k in ("enc_busy", "enc_queue", "enc_wait", "lm_load", "lm_waiting", "lm_wait")}
        self.actions: list[tuple[float, str, int]] = []

    def _wait(self, fleet, role: str) -> float | None:
        total, n = fleet.waits[role]
        t0, n0 = self.waits_seen[role]
        self.waits_seen[role] = (total, n)
        return (total - t0) / (n - n0) if n > n0 else None

    def _read(self, fleet, now: float) -> None:
        window = max(now - self.t_seen, 1e-9)
        encs = fleet.active("encoder")
        busy = 0.0
        for e in encs:
            b = e.busy_until(now)
            busy += min(1.0, (b - self.busy_seen.get(id(e), b)) / window)
            self.busy_seen[id(e)] = b
        self.t_seen = now
        lms = fleet.active("lm")
        raw = {
            "enc_busy": busy / len(encs) if encs else 0.0,
            "enc_queue": sum(e.load for e in encs) / len(encs) if encs else 0.0,
            "enc_wait": self._wait(fleet, "encoder"),
            "lm_load": sum(m.load for m in lms) / (len(lms) * fleet.profile.lm.max_seqs) if lms else 0.0,
            "lm_waiting": sum(m.queued for m in lms) / len(lms) if lms else 0.0,
            "lm_wait": self._wait(fleet, "lm"),
        }
        a = self.cfg.smooth
        for k, v in raw.items():
            if v is not None:  # no item or request started in the window: keep the last estimate
                self.sig[k] = a * v + (1 - a) * self.sig[k]

    def _pressure(self) -> dict[str, float]:
        """How far past its hot thresholds each role is (1.0 = at them)."""
        c, s = self.cfg, self.sig
        return {"encoder": max(s["enc_wait"] / c.enc_wait_hi, s["enc_queue"] / c.enc_queue_hi),
                "lm": max(s["lm_wait"] / c.lm_wait_hi, s["lm_waiting"] / c.lm_waiting_hi)}

    def _util(self, role: str) -> tuple[float, float, float]:
        c, s = self.cfg, self.sig
        if role == "encoder":
            return s["enc_busy"], c.enc_busy_lo, c.enc_busy_hi
        return s["lm_load"], c.lm_load_lo, c.lm_load_hi

    def _room(self, role: str, n: int, k: int) -> bool:
        """``role`` would stay below its high utilisation with ``k`` fewer of its ``n`` instances."""
        util, _, hi = self._util(role)
        return n - k >= 1 and self._pressure()[role] < self.cfg.room and util * n / (n - k) < hi

    @staticmethod
    def _in_flight(fleet) -> bool:
        """The last action has not landed: an instance still provisioning, or a GPU still draining for
        an instance that waits for it. Deciding again now would count the same shortage twice."""
        return bool(fleet.pending) or any(i.state == "provisioning" for i in (*fleet.encoders, *fleet.lms))

    def step(self, fleet, now: float) -> None:
        self._read(fleet, now)
        if now - self.last_action < self.cfg.cooldown_s or self._in_flight(fleet):
            return
        c = self.cfg
        p = self._pressure()
        n = {r: len(fleet.active(r)) for r in p}
        hot = max(p, key=p.get)
        other = "lm" if hot == "encoder" else "encoder"
        free = c.budget - fleet.held - len(fleet.pending)
        if p[hot] >= 1.0:
            k = min(c.max_step, max(1, math.ceil(n[hot] * (min(p[hot], c.pressure_cap) - 1.0))))
            if free > 0:  # room in the budget: grow the hot role
                k = min(k, free)
                for _ in range(k):
                    fleet.add(hot, now, c.budget)
                self._done(now, f"add {hot}", k)
                return
            while k > 0 and not self._room(other, n[other], k):
                k -= 1
            if k > 0:
                self._act(fleet, now, other, hot, k)
        elif fleet.held > c.min_gpus:  # above the floor, nothing hot: a cold role gives a GPU back
            for role in ("encoder", "lm"):
                util, lo, _ = self._util(role)
                if util < lo and self._room(role, n[role], 1):
                    self._act(fleet, now, role, None, 1)
                    break

    def _act(self, fleet, now: float, drain: str, add: str | None, k: int) -> None:
        for _ in range(k):
            fleet.drain(drain, now)
            if add is not None:
                fleet.add(add, now, self.cfg.budget)
        self._done(now, f"{drain} -> {add or 'pool'}", k)

    def _done(self, now: float, what: str, k: int) -> None:
        self.last_action = now
        self.actions.append((now, what, k))
