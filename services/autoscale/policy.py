"""The local autoscaler's decision: from one snapshot of the fleet's scaling signals, whether to add or
remove an encoder or an LM, within a budget and with hysteresis. Pure: no I/O, no clock of its own (the
caller passes ``now``), so tests drive it with made-up snapshots (tests/unit/test_autoscale_policy.py).
``services.autoscale.loop`` scrapes the signals and acts on the deployment.

Each role's load is one number, 0 (idle) to 1 (full) and beyond (a queue), averaged over the instances that
serve (a draining one is not capacity):

- encoder: its busy share (``rate(epd_encoder_busy_seconds_total)``), or its queue depth
  (``epd_encoder_queue_depth``) over ``encoder_queue_full`` where that is larger (a queue says "short" before
  the busy share reaches 1 on a host whose cores the engines share);
- LM: (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) over its ``max_num_seqs``.

Hysteresis, three ways: a role grows when its load has stayed at or above ``up_threshold`` for
``up_after_s``, and shrinks when it has stayed at or below ``down_threshold`` for ``down_after_s`` and
the instances left would still be under ``up_threshold`` (so a removal never asks for an addition at
once); after any change of a role, that role waits ``cooldown_s`` (its new instance starts, its signals
settle). One change per role per decision; never below ``min_*`` nor above ``max_*`` or the memory budget.

Owner: one ``Policy`` per autoscaler; its timers are its only state (``decide`` updates them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("encoder", "lm")


@dataclass
class Budget:
    """``epd up --autoscale``'s flags (``--autoscale-*``): the fleet's bounds and the hysteresis."""

    min_encoders: int = 1
    """Never fewer encoders (at least 1)."""
    max_encoders: int = 3
    """Never more encoders."""
    min_lms: int = 1
    """Never fewer LMs (at least 1)."""
    max_lms: int = 2
    """Never more LMs."""
    max_memory_gib: float = 0.0
    """The memory every encoder and LM together may use (their process trees' resident memory); a new
    instance is assumed to need what the largest of its role uses now. 0: no memory bound."""
    up_threshold: float = 0.75
    """A role's load at or above this (sustained ``up_after_s``) adds an instance."""
    down_threshold: float = 0.25
    """A role's load at or below this (sustained ``down_after_s``) removes one."""
    up_after_s: float = 6.0
    """How long the load must stay high before an instance is added."""
    down_after_s: float = 20.0
    """How long the load must stay low before an instance is removed."""
    cooldown_s: float = 30.0
    """After a role changed, how long before it changes again."""
    encoder_queue_full: float = 4.0
    """Items waiting per encoder that count as a full encoder (load 1)."""

    def __post_init__(self) -> None:
        if not (1 <= self.min_encoders <= self.max_encoders and 1 <= self.min_lms <= self.max_lms):
            raise ValueError("need 1 <= min_encoders <= max_encoders and 1 <= min_lms <= max_lms; got "
                             f"{self.min_encoders}..{self.max_encoders} and {self.min_lms}..{self.max_lms}")
        if not 0 <= self.down_threshold < self.up_threshold:
            raise ValueError(f"need 0 <= down_threshold < up_threshold; got {self.down_threshold} and "
                             f"{self.up_threshold}")
        if min(self.up_after_s, self.down_after_s, self.cooldown_s, self.max_memory_gib) < 0 \
                or self.encoder_queue_full <= 0:
            raise ValueError("up_after_s, down_after_s, cooldown_s and max_memory_gib must be >= 0, "
                             "encoder_queue_full > 0")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_encoders, self.max_encoders) if role == "encoder" else (self.min_lms, self.max_lms)


@dataclass
class InstanceSignals:
    """One instance's signals in a snapshot (what the loop scraped from its metrics port)."""

    address: str
    draining: bool = False
    busy: float = 0.0
    """Encoder: busy share over the last interval, 0..1."""
    queue: float = 0.0
    """Encoder: items admitted and not yet encoded."""
    running: float = 0.0
    """LM: requests running in the engine."""
    waiting: float = 0.0
    """LM: requests waiting in the engine."""
    slots: int = 1
    """LM: its max_num_seqs."""
    memory_bytes: int = 0
    """Resident memory of its process tree."""


@dataclass
class Snapshot:
    """The fleet's signals at one moment."""

    encoders: list[InstanceSignals] = field(default_factory=list)
    lms: list[InstanceSignals] = field(default_factory=list)

    def of(self, role: str) -> list[InstanceSignals]:
        return self.encoders if role == "encoder" else self.lms


@dataclass(frozen=True)
class Action:
    """Add one instance of ``role``, or remove the one at ``address``."""

    kind: str  # "add" or "remove"
    role: str
    address: str = ""
    reason: str = ""


def instance_load(role: str, inst: InstanceSignals, budget: Budget) -> float:
    if role == "encoder":
        return max(inst.busy, inst.queue / budget.encoder_queue_full)
    return (inst.running + inst.waiting) / max(1, inst.slots)


def role_load(role: str, snapshot: Snapshot, budget: Budget) -> float | None:
    """The mean load of ``role``'s serving instances; None when none serves (nothing to average)."""
    serving = [i for i in snapshot.of(role) if not i.draining]
    if not serving:
        return None
    return sum(instance_load(role, i, budget) for i in serving) / len(serving)


def _since(started: float | None, now: float) -> float:
    return now if started is None else started


class Policy:
    """``decide(snapshot, now)``: the actions to take now (at most one per role)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._high_since: dict[str, float | None] = {r: None for r in ROLES}
        self._low_since: dict[str, float | None] = {r: None for r in ROLES}
        self._changed_at: dict[str, float] = {r: float("-inf") for r in ROLES}

    def changed(self, role: str, now: float) -> None:
        """A change of ``role`` was made (by ``decide``'s caller, or outside it: an instance that exited):
        the cool-down starts, and the load timers start again."""
        self._changed_at[role] = now
        self._high_since[role] = self._low_since[role] = None

    def decide(self, snapshot: Snapshot, now: float, skip: frozenset[str] = frozenset()) -> list[Action]:
        """``skip``: roles not decided now (a change of theirs is still in flight); their timers restart."""
        actions = []
        for role in ROLES:
            if role in skip:
                self._high_since[role] = self._low_since[role] = None
                continue
            action = self._decide_role(role, snapshot, now)
            if action is not None:
                self.changed(role, now)
                actions.append(action)
        return actions

    def _decide_role(self, role: str, snapshot: Snapshot, now: float) -> Action | None:
        b = self.budget
        load = role_load(role, snapshot, b)
        serving = [i for i in snapshot.of(role) if not i.draining]
        n = len(serving)
        lo, hi = b.bounds(role)
        if load is None:
            self._high_since[role] = self._low_since[role] = None
            if n < lo and now - self._changed_at[role] >= b.cooldown_s:
                return Action("add", role, reason=f"no {role} serves (min {lo})")
            return None
        self._high_since[role] = _since(self._high_since[role], now) if load >= b.up_threshold else None
        self._low_since[role] = _since(self._low_since[role], now) if load <= b.down_threshold else None
        if now - self._changed_at[role] < b.cooldown_s:
            return None
        if n < lo:
            return Action("add", role, reason=f"{n} {role}(s) serve, fewer than the minimum {lo}")
        high, low = self._high_since[role], self._low_since[role]
        if high is not None and now - high >= b.up_after_s and n < hi and self._memory_fits(role, snapshot):
            return Action("add", role, reason=f"load {load:.2f} >= {b.up_threshold} for {now - high:.0f}s")
        if low is not None and now - low >= b.down_after_s and n > lo and load * n / (n - 1) < b.up_threshold:
            victim = min(reversed(serving), key=lambda i: instance_load(role, i, b))  # least busy, newest on ties
            return Action("remove", role, victim.address,
                          reason=f"load {load:.2f} <= {b.down_threshold} for {now - low:.0f}s")
        return None

    def _memory_fits(self, role: str, snapshot: Snapshot) -> bool:
        if not self.budget.max_memory_gib:
            return True
        used = sum(i.memory_bytes for r in ROLES for i in snapshot.of(r))
        need = max((i.memory_bytes for i in snapshot.of(role)), default=0)
        return used + need <= self.budget.max_memory_gib * (1 << 30)
