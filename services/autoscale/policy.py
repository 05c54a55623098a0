"""The local autoscaler's decision: from one snapshot of the fleet's scaling signals, whether to add or
remove an encoder or an LM, within a budget and with hysteresis. Pure: no I/O, no clock of its own (the
caller passes ``now``), so tests drive it with made-up snapshots (tests/unit/test_autoscale_policy.py).
``services.autoscale.loop`` scrapes the signals and acts on the deployment.

Each role is judged on the signal that says a request is late there, not on how busy it looks (a batching
encoder can be busy all the time and keep up; an LM can hold few of its ``max_num_seqs`` and still miss
TPOT). Its *lateness* is that signal over its objective: 0 on time with nothing waiting, 1 at the
objective, averaged over the instances that serve and have a reading (a draining one is not capacity):

- encoder: the mean time an item waited before its batch started, over the last interval (in front of the
  engine, ``epd_encoder_service_wait_seconds_total``, plus in the encoder engine's scheduler,
  ``vllm:request_queue_time_seconds``), over ``encoder_wait_s``;
- LM: the larger of its TTFT p90 over ``ttft_s`` and its TPOT p90 over ``tpot_s``, over the last interval
  (vLLM's ``vllm:time_to_first_token_seconds`` and ``vllm:request_time_per_output_token_seconds``);
  ``epd up --autoscale`` gives ``ttft_s``/``tpot_s`` to its gateway as ``--objective-ttft-ms``/``-tpot-ms``
  (``Budget.gateway_args``).

An instance with no reading (no item started, no first token and no request finished in the interval) is
left out of the mean; a role where none has one reads 0 (nothing was late).

A late role grows when its lateness has stayed at or above ``up_threshold`` for ``up_after_s``: by
``ceil(n * (lateness / up_threshold - 1))`` of its ``n`` instances, at least 1, at most ``max_step`` and what
``max_*`` and the memory budget hold. What the memory budget cannot hold, the other role may give: as many
of its instances (least late first) as leave its own lateness, scaled by ``n / (n - k)``, at or under
``give_threshold`` (the late role then grows once they have drained and their memory is free). Apart
from that, a role shrinks by one when its lateness has stayed at or below ``down_threshold`` for
``down_after_s`` and would still be there with one instance fewer. Encoders give an instance away (either
way) only while their busy share with fewer would stay under ``encoder_busy_room``: their queueing time
stays near 0 until they are nearly full, so it cannot say how much room is left.

Hysteresis, three ways: the thresholds apart (``down_threshold`` <= ``give_threshold`` <= ``up_threshold``),
the times a lateness must last, and after any change of a role that role waits ``cooldown_s`` (its new
instances start, its signals settle). One change of a role per decision; never below ``min_*`` nor above
``max_*`` or the memory budget.

Owner: one ``Policy`` per autoscaler; its timers are its only state (``decide`` updates them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROLES = ("encoder", "lm")


@dataclass
class Budget:
    """``epd up --autoscale``'s flags (``--autoscale-*``): the fleet's bounds, the objectives each role's
    lateness is read against, and the hysteresis."""

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
    encoder_wait_s: float = 0.5
    """Seconds an item may wait for its encoder batch to start: the encoders' lateness 1."""
    ttft_s: float = 2.0
    """The LMs' TTFT objective in seconds (the gateway's ``--objective-ttft-ms``): a TTFT p90 there is
    lateness 1."""
    tpot_s: float = 0.2
    """The LMs' TPOT objective in seconds (the gateway's ``--objective-tpot-ms``): a TPOT p90 there is
    lateness 1."""
    up_threshold: float = 0.75
    """A role's lateness at or above this (sustained ``up_after_s``) adds an instance: a margin under the
    objective for the time a new instance takes to start."""
    down_threshold: float = 0.4
    """A role's lateness at or below this (sustained ``down_after_s``, and still so with one instance fewer)
    removes one."""
    up_after_s: float = 6.0
    """How long the lateness must stay high before an instance is added."""
    down_after_s: float = 20.0
    """How long the lateness must stay low before an instance is removed."""
    cooldown_s: float = 30.0
    """After a role changed, how long before it changes again."""
    give_threshold: float = 0.6
    """A role gives instances to the other role, late and unable to grow within ``max_memory_gib``, only while
    its own lateness with that many fewer would stay at or under this (between the two thresholds above)."""
    encoder_busy_room: float = 0.7
    """Encoders give an instance away only while their busy share with one fewer would stay under this: an
    encoder's queueing time stays near 0 until it is nearly full, so it cannot say how much room is left."""
    max_step: int = 1
    """Most instances one decision adds to a role: a role late by ``x`` times ``up_threshold`` asks for
    ``ceil(n * (x - 1))`` more of its ``n``, at least 1, at most this (and what the bounds allow)."""

    def __post_init__(self) -> None:
        if not (1 <= self.min_encoders <= self.max_encoders and 1 <= self.min_lms <= self.max_lms):
            raise ValueError("need 1 <= min_encoders <= max_encoders and 1 <= min_lms <= max_lms; got "
                             f"{self.min_encoders}..{self.max_encoders} and {self.min_lms}..{self.max_lms}")
        if not (0 <= self.down_threshold <= self.give_threshold <= self.up_threshold
                and self.down_threshold < self.up_threshold):
            raise ValueError(f"need 0 <= down_threshold <= give_threshold <= up_threshold, down below up; got "
                             f"{self.down_threshold}, {self.give_threshold} and {self.up_threshold}")
        if min(self.up_after_s, self.down_after_s, self.cooldown_s, self.max_memory_gib) < 0 \
                or min(self.encoder_wait_s, self.ttft_s, self.tpot_s, self.encoder_busy_room) <= 0 \
                or self.max_step < 1:
            raise ValueError("up_after_s, down_after_s, cooldown_s and max_memory_gib must be >= 0, "
                             "encoder_wait_s, ttft_s, tpot_s and encoder_busy_room > 0, max_step >= 1")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_encoders, self.max_encoders) if role == "encoder" else (self.min_lms, self.max_lms)

    def gateway_args(self) -> list[str]:
        """The gateway's objective flags for these objectives, so that the attainment it publishes reads
        the LMs against what the autoscaler does (``epd up --autoscale`` passes them before the user's
        ``--gateway-args``, which win)."""
        return [f"--objective-ttft-ms={self.ttft_s * 1000:g}", f"--objective-tpot-ms={self.tpot_s * 1000:g}"]


@dataclass
class InstanceSignals:
    """One instance's signals in a snapshot (what the loop scraped from its metrics port); None: no reading
    in the interval."""

    address: str
    draining: bool = False
    queue_wait_s: float | None = None
    """Encoder: mean seconds an item waited before its batch started, over the last interval."""
    busy: float = 0.0
    """Encoder: busy share over the last interval, 0..1 (only whether it has room to give one away)."""
    ttft_s: float | None = None
    """LM: TTFT p90 over the last interval, seconds."""
    tpot_s: float | None = None
    """LM: TPOT p90 of the requests that finished in the last interval, seconds."""
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
    """Add ``count`` instances of ``role``, or remove the one at ``address``."""

    kind: str  # "add" or "remove"
    role: str
    address: str = ""
    reason: str = ""
    count: int = 1


def instance_lateness(role: str, inst: InstanceSignals, budget: Budget) -> float | None:
    """``inst``'s late-signal over its objective (1: at it); None without a reading."""
    if role == "encoder":
        return None if inst.queue_wait_s is None else inst.queue_wait_s / budget.encoder_wait_s
    parts = [v / o for v, o in ((inst.ttft_s, budget.ttft_s), (inst.tpot_s, budget.tpot_s)) if v is not None]
    return max(parts) if parts else None


def role_lateness(role: str, snapshot: Snapshot, budget: Budget) -> float | None:
    """The mean lateness of ``role``'s serving instances that have a reading (0 where none has); None when
    none serves."""
    serving = [i for i in snapshot.of(role) if not i.draining]
    if not serving:
        return None
    read = [x for x in (instance_lateness(role, i, budget) for i in serving) if x is not None]
    return sum(read) / len(read) if read else 0.0


def _since(started: float | None, now: float) -> float:
    return now if started is None else started


class Policy:
    """``decide(snapshot, now)``: the actions to take now (at most one change per role: one addition of
    ``count`` instances, or removals)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._high_since: dict[str, float | None] = {r: None for r in ROLES}
        self._low_since: dict[str, float | None] = {r: None for r in ROLES}
        self._changed_at: dict[str, float] = {r: float("-inf") for r in ROLES}

    def changed(self, role: str, now: float) -> None:
        """A change of ``role`` was made (by ``decide``'s caller, or outside it: an instance that exited):
        the cool-down starts, and the lateness timers start again."""
        self._changed_at[role] = now
        self._high_since[role] = self._low_since[role] = None

    def decide(self, snapshot: Snapshot, now: float, skip: frozenset[str] = frozenset()) -> list[Action]:
        """``skip``: roles not decided now (a change of theirs is still in flight); their timers restart."""
        actions, blocked = [], {}
        for role in ROLES:
            if role in skip:
                self._high_since[role] = self._low_since[role] = None
                continue
            decided, blocked[role] = self._decide_role(role, snapshot, now)
            if decided:
                self.changed(role, now)
                actions += decided
        for role, want in blocked.items():
            other = ROLES[1 - ROLES.index(role)]
            if want and other in blocked and not any(a.role == other for a in actions):
                given = self._give(other, snapshot, now, want, role)
                if given:
                    self.changed(other, now)
                    actions += given
        return actions

    def _decide_role(self, role: str, snapshot: Snapshot, now: float) -> tuple[list[Action], int]:
        """``role``'s own change now, and how many instances it asks for that the memory budget cannot hold
        (the other role may give them: ``_give``)."""
        b = self.budget
        late = role_lateness(role, snapshot, b)
        serving = [i for i in snapshot.of(role) if not i.draining]
        n = len(serving)
        lo, hi = b.bounds(role)
        if late is None:
            self._high_since[role] = self._low_since[role] = None
            if n < lo and now - self._changed_at[role] >= b.cooldown_s:
                return [Action("add", role, reason=f"no {role} serves (min {lo})")], 0
            return [], 0
        self._high_since[role] = _since(self._high_since[role], now) if late >= b.up_threshold else None
        self._low_since[role] = _since(self._low_since[role], now) if late <= b.down_threshold else None
        if now - self._changed_at[role] < b.cooldown_s:
            return [], 0
        if n < lo:
            return [Action("add", role, reason=f"{n} {role}(s) serve, fewer than the minimum {lo}")], 0
        high, low = self._high_since[role], self._low_since[role]
        if high is not None and now - high >= b.up_after_s and n < hi:
            want = min(b.max_step, hi - n, max(1, math.ceil(n * (late / b.up_threshold - 1))))
            k = min(want, self._fits(role, snapshot))
            reason = f"lateness {late:.2f} >= {b.up_threshold} for {now - high:.0f}s"
            return ([Action("add", role, reason=reason, count=k)] if k > 0 else []), want - k
        if low is not None and now - low >= b.down_after_s and n > lo \
                and self._room(role, serving, late, 1, b.down_threshold):
            victim = self._least_late(role, serving, 1)[0]
            return [Action("remove", role, victim.address,
                           reason=f"lateness {late:.2f} <= {b.down_threshold} for {now - low:.0f}s")], 0
        return [], 0

    def _give(self, role: str, snapshot: Snapshot, now: float, want: int, to: str) -> list[Action]:
        """Up to ``want`` of ``role``'s instances removed for ``to``, which is late and cannot grow within the
        memory budget (less those of ``role`` already draining): as many as leave ``role``'s lateness (and
        busy share) room under ``give_threshold``."""
        b = self.budget
        late = role_lateness(role, snapshot, b)
        serving = [i for i in snapshot.of(role) if not i.draining]
        want -= len(snapshot.of(role)) - len(serving)  # those draining already free memory for ``to``
        if late is None or now - self._changed_at[role] < b.cooldown_s:
            return []
        k = next((k for k in range(min(want, len(serving) - b.bounds(role)[0]), 0, -1)
                  if self._room(role, serving, late, k, b.give_threshold)), 0)
        return [Action("remove", role, v.address, reason=f"for the {to}s: lateness {late:.2f}, under "
                       f"{b.give_threshold} with {k} fewer") for v in self._least_late(role, serving, k)]

    def _least_late(self, role: str, serving: list[InstanceSignals], k: int) -> list[InstanceSignals]:
        """The ``k`` least late, newest first on ties (no reading: idle, the least late of all)."""
        return sorted(reversed(serving), key=lambda i: instance_lateness(role, i, self.budget) or 0.0)[:k]

    def _room(self, role: str, serving: list[InstanceSignals], late: float, k: int, threshold: float) -> bool:
        """Whether ``role`` can give ``k`` of its ``serving`` instances: its lateness scaled to ``k`` fewer stays
        at or under ``threshold``, and for encoders their busy share so scaled under ``encoder_busy_room``."""
        n, b = len(serving), self.budget
        if k < 1 or late * n / (n - k) > threshold:
            return False
        return role != "encoder" or sum(i.busy for i in serving) / (n - k) < b.encoder_busy_room

    def _fits(self, role: str, snapshot: Snapshot) -> int:
        """How many more of ``role`` the memory budget holds (each as the largest of its role now)."""
        if not self.budget.max_memory_gib:
            return self.budget.max_step
        used = sum(i.memory_bytes for r in ROLES for i in snapshot.of(r))
        need = max((i.memory_bytes for i in snapshot.of(role)), default=0)
        free = self.budget.max_memory_gib * (1 << 30) - used
        if need <= 0:  # nothing measured yet: one fits while the budget is not past
            return self.budget.max_step if free >= 0 else 0
        return max(0, int(free // need))
