"""The project's own autoscaling decision (``services/autoscale/policy.py``, what ``epd up --autoscale``
runs) driven inside the simulator: every ``tick_s`` the fleet's instances become a ``Snapshot`` of the
same signals the loop scrapes, read as deltas since the last tick as the loop reads its counters and
histograms (encoder: the mean time an item waited before its batch started, vLLM's request queue time on
the encoder; LM: TTFT p90 from the time a request was routed there, and the TPOT p90 of the requests that
finished, vLLM's TTFT and TPOT histograms), ``Policy.decide`` answers, and its actions are applied to the
simulated fleet (add: a new instance after the fleet's ``provision_s``; remove: that instance drains). The
policy is pure, so nothing of it is re-implemented here.

The GPU budget is the policy's memory budget: every instance, draining ones too, counts 1 GiB, and
``max_memory_gib`` is the number of GPUs. A role with a change in flight (an instance provisioning) is
passed in ``skip``, as the loop does. Owner: one ``LocalPolicy`` per simulation run.
"""

from __future__ import annotations

import numpy as np

from services.autoscale.policy import Budget, InstanceSignals, Policy, Snapshot, role_lateness

GIB = 1 << 30
QUANTILE = 90


def _p90(values: list) -> float | None:
    return float(np.percentile(values, QUANTILE)) if values else None


class LocalPolicy:
    def __init__(self, budget: Budget, tick_s: float):
        self.policy = Policy(budget)
        self.tick_s = tick_s
        self.waits_seen: dict[int, tuple[float, int]] = {}
        self.busy_seen: dict[int, float] = {}
        self.t_seen = 0.0
        self.actions: list[tuple[float, str, int]] = []
        self.trace: list[tuple] = []  # (t, encoder lateness, LM lateness) each tick

    def _encoder(self, e, now: float, window: float) -> InstanceSignals:
        b = e.busy_until(now)
        busy = min(1.0, (b - self.busy_seen.get(id(e), b)) / window)
        self.busy_seen[id(e)] = b
        total, n = e.waited
        t0, n0 = self.waits_seen.get(id(e), (0.0, 0))
        self.waits_seen[id(e)] = (total, n)
        wait = (total - t0) / (n - n0) if n > n0 else None
        return InstanceSignals(f"e{e.idx}", draining=e.state == "draining", queue_wait_s=wait, busy=busy,
                              memory_bytes=GIB)

    def snapshot(self, fleet, now: float) -> tuple[Snapshot, dict[str, object]]:
        window = max(now - self.t_seen, 1e-9)
        self.t_seen = now
        snap, by_address = Snapshot(), {}
        for e in fleet.encoders:
            if e.state in ("gone", "provisioning"):
                continue
            inst = self._encoder(e, now, window)
            by_address[inst.address] = e
            snap.encoders.append(inst)
        for m in fleet.lms:
            if m.state in ("gone", "provisioning"):
                continue
            (ttfts, tpots), m.ttfts, m.tpots = (m.ttfts, m.tpots), [], []
            address = f"l{m.idx}"
            by_address[address] = m
            snap.lms.append(InstanceSignals(address, draining=m.state == "draining", ttft_s=_p90(ttfts),
                                            tpot_s=_p90(tpots), memory_bytes=GIB))
        # Provisioning instances hold a GPU too: the memory budget must see them.
        for role, insts in (("encoder", fleet.encoders), ("lm", fleet.lms)):
            for i in insts:
                if i.state == "provisioning":
                    snap.of(role).append(InstanceSignals(f"p{role}{i.idx}", draining=True, memory_bytes=GIB))
        return snap, by_address

    def step(self, fleet, now: float) -> None:
        snap, by_address = self.snapshot(fleet, now)
        b = self.policy.budget
        self.trace.append((now, role_lateness("encoder", snap, b), role_lateness("lm", snap, b)))
        skip = frozenset(r for r, insts in (("encoder", fleet.encoders), ("lm", fleet.lms))
                         if any(i.state == "provisioning" for i in insts))
        for action in self.policy.decide(snap, now, skip):
            if action.kind == "add":
                for _ in range(action.count):
                    fleet.add(action.role, now, b.max_memory_gib)
            else:
                fleet.drain_instance(by_address[action.address], now)
            self.actions.append((now, f"{action.kind} {action.role}", action.count))
