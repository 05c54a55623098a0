"""The project's own autoscaling decision (``services/autoscale/policy.py``, what ``epd up --autoscale``
runs) driven inside the simulator: every ``tick_s`` the fleet's instances become a ``Snapshot`` of the
same signals the loop scrapes (encoder busy share and queue; LM running, waiting and ``max_num_seqs``),
``Policy.decide`` answers, and its actions are applied to the simulated fleet (add: a new instance after
the fleet's ``provision_s``; remove: that instance drains). The policy is pure, so nothing of it is
re-implemented here.

The GPU budget is the policy's memory budget: every instance, draining ones too, counts 1 GiB, and
``max_memory_gib`` is the number of GPUs. A role with a change in flight (an instance provisioning) is
passed in ``skip``, as the loop does. Owner: one ``LocalPolicy`` per simulation run.
"""

from __future__ import annotations

from services.autoscale.policy import Budget, InstanceSignals, Policy, Snapshot

GIB = 1 << 30


class LocalPolicy:
    def __init__(self, budget: Budget, tick_s: float):
        self.policy = Policy(budget)
        self.tick_s = tick_s
        self.busy_seen: dict[int, float] = {}
        self.t_seen = 0.0
        self.actions: list[tuple[float, str, int]] = []

    def _snapshot(self, fleet, now: float) -> tuple[Snapshot, dict[str, object]]:
        window = max(now - self.t_seen, 1e-9)
        self.t_seen = now
        snap, by_address = Snapshot(), {}
        for e in fleet.encoders:
            if e.state in ("gone", "provisioning"):
                continue
            b = e.busy_until(now)
            busy = min(1.0, (b - self.busy_seen.get(id(e), b)) / window)
            self.busy_seen[id(e)] = b
            address = f"e{e.idx}"
            by_address[address] = e
            snap.encoders.append(InstanceSignals(address, draining=e.state == "draining", busy=busy,
                                                 queue=float(e.load), memory_bytes=GIB))
        for m in fleet.lms:
            if m.state in ("gone", "provisioning"):
                continue
            address = f"l{m.idx}"
            by_address[address] = m
            snap.lms.append(InstanceSignals(address, draining=m.state == "draining",
                                            running=float(m.n_run + len(m.prefilling)),
                                            waiting=float(len(m.waiting)), slots=m.cost.max_seqs,
                                            memory_bytes=GIB))
        # Provisioning instances hold a GPU too: the memory budget must see them.
        for role, insts in (("encoder", fleet.encoders), ("lm", fleet.lms)):
            for i in insts:
                if i.state == "provisioning":
                    snap.of(role).append(InstanceSignals(f"p{role}{i.idx}", draining=True, memory_bytes=GIB))
        return snap, by_address

    def step(self, fleet, now: float) -> None:
        snap, by_address = self._snapshot(fleet, now)
        skip = frozenset(r for r, insts in (("encoder", fleet.encoders), ("lm", fleet.lms))
                         if any(i.state == "provisioning" for i in insts))
        for action in self.policy.decide(snap, now, skip):
            if action.kind == "add":
                fleet.add(action.role, now, self.policy.budget.max_memory_gib)
            else:
                fleet.drain_instance(by_address[action.address], now)
            self.actions.append((now, f"{action.kind} {action.role}", 1))
