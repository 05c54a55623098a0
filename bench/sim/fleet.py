"""The fleet model: gateway routing, encoder instances, transfers, LM instances, and the event loop.

One ``Fleet`` simulates one trace once. It owns every ``Req``, instance and event; nothing is shared
between runs. Events are ``(time, seq, handler, arg)`` on one heap; ``seq`` breaks ties in the order
events were made, so a run is a function of the trace and the costs alone.

Paths, as the services take them (``docs/design.md``):

- text request: ``front_s``, then the LM with the fewest outstanding requests (the gateway's
  ``--lm-routing load``).
- image request, split fleet: ``front_s + meta_s`` (the metadata round trip), then each image,
  after ``preprocess_s``, to the encoder with the fewest items queued or running (least busy, as the
  gateway's encoder policies when nothing is held); an encoder runs batches of up to ``max_batch``
  items; each item lands after its transfer; once all have landed, the request goes to an LM as text
  does (the LM prefills the image tokens from the embeddings).
- image request, colocated fleet: ``front_s + preprocess_s``, then an LM, which encodes the images in
  the step that starts the request's prefill: every request decoding on that LM waits for it.

An LM steps while it holds work. Steps that only decode are simulated in runs (one event per run,
up to the next completion); a request arriving mid-run cuts the run at the step then in flight, and
the next step prefills (up to ``chunk_tokens``) beside the decodes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from sim.costs import Profile
from sim.trace import Trace

PROVISIONING, ACTIVE, DRAINING, GONE = "provisioning", "active", "draining", "gone"
IDLE, PREFILL, DECODE = 0, 1, 2


class Req:
    __slots__ = ("i", "prompt_total", "n_img", "img_tok", "out", "items_left", "pf_left", "encoded",
                 "t_first", "t_done", "kv", "t_lm")

    def __init__(self, i: int, prompt: int, n_img: int, img_tok: int, out: int):
        self.i = i
        self.prompt_total = prompt + n_img * img_tok
        self.n_img, self.img_tok, self.out = n_img, img_tok, out
        self.items_left = n_img
        self.pf_left = self.prompt_total
        self.encoded = False
        self.t_first = self.t_done = self.t_lm = math.nan
        self.kv = 0


class Encoder:
    """A queue of items and one running batch. The fleet calls ``submit`` with ``(request, tokens)``;
    the encoder stamps the time (each item's wait for its batch feeds ``Fleet.waits``, the autoscaler's
    queueing signal) and calls the fleet back (``land`` after each item's transfer, ``retire`` once
    drained and idle)."""

    def __init__(self, fleet: Fleet, idx: int):
        self.fleet, self.idx = fleet, idx
        self.state = PROVISIONING
        self.queue: deque = deque()
        self.batch: list = []
        self.busy_since = math.nan
        self.busy_total = 0.0
        self.waited = [0.0, 0]  # this encoder's item queue seconds and count, ever

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.batch)

    @property
    def drain_cost(self) -> int:
        return self.load

    def busy_until(self, now: float) -> float:
        return self.busy_total + (now - self.busy_since if self.batch else 0.0)

    def submit(self, item, now: float) -> None:
        self.queue.append((*item[:2], now))
        if not self.batch:
            self._start(now)

    def _start(self, now: float) -> None:
        cost = self.fleet.profile.encoder
        n = min(len(self.queue), cost.max_batch)
        self.batch = [self.queue.popleft() for _ in range(n)]
        self.busy_since = now
        for waits in (self.fleet.waits["encoder"], self.waited):
            for _, _, t in self.batch:
                waits[0] += now - t
                waits[1] += 1
        dt = cost.batch_s(n, sum(tok for _, tok, _ in self.batch)) * self.fleet.slowdown
        self.fleet.push(now + dt, self._done, None)

    def _done(self, now: float, _) -> None:
        self.busy_total += now - self.busy_since
        path = self.fleet.profile.path
        for req, tok, _ in self.batch:
            self.fleet.push(now + path.transfer_s(tok), self.fleet.land, req)
        self.batch = []
        if self.queue:
            self._start(now)
        elif self.state == DRAINING:
            self.fleet.retire(self, now)

    def drain(self, now: float) -> list:
        """Stop taking work; hand back what has not started (the fleet re-routes it)."""
        self.state = DRAINING
        left, self.queue = list(self.queue), deque()
        if not self.batch:
            self.fleet.retire(self, now)
        return left


class LM:
    """Continuous batching. ``waiting`` (routed here, no KV yet) -> ``prefilling`` (KV reserved, prompt
    being computed in chunks) -> decoding (``n_run``; a heap of the step count at which each ends)."""

    def __init__(self, fleet: Fleet, idx: int, colocated: bool):
        self.fleet, self.idx, self.colocated = fleet, idx, colocated
        self.cost = fleet.profile.lm
        self.state = PROVISIONING
        self.waiting: deque = deque()
        self.prefilling: list = []
        self.finishing: list = []  # heap of (step, req.i, req)
        self.n_run = 0
        self.steps = 0
        self.kv_used = 0
        self.mode = IDLE
        self.t0 = self.dt = 0.0
        self.k = 0
        self.version = 0
        self.just_prefilled: list = []
        self.ttfts, self.tpots = [], []  # TTFTs (from routed here) and TPOTs since a reader last took them

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.n_run

    @property
    def queued(self) -> int:
        """Requests not yet started (vLLM's ``num_requests_waiting``): routed here, or holding KV with
        no prompt token computed yet."""
        return len(self.waiting) + sum(1 for r in self.prefilling if r.pf_left == r.prompt_total)

    @property
    def drain_cost(self) -> int:
        """Decode steps until the last request this LM holds would end: the LM that frees its GPU
        soonest is the one to drain."""
        last = max((step for step, _, _ in self.finishing), default=self.steps)
        return last - self.steps + sum(r.out for r in self.prefilling)

    def submit(self, req: Req, now: float) -> None:
        req.t_lm = now
        self.waiting.append(req)
        if self.mode == IDLE:
            self._plan(now)
        elif self.mode == DECODE:  # cut the decode run at the step in flight
            done = min(self.k, int((now - self.t0) / self.dt) + 1)
            if done < self.k:
                self.k = done
                self.version += 1
                self.fleet.push(self.t0 + done * self.dt, self._wake, self.version)

    def _admit(self) -> None:
        c = self.cost
        while self.waiting and self.n_run + len(self.prefilling) < c.max_seqs:
            r = self.waiting[0]
            need = r.prompt_total + r.out
            if self.kv_used + need > c.kv_tokens and (self.n_run or self.prefilling):
                break
            self.waiting.popleft()
            r.kv = need
            self.kv_used += need
            self.prefilling.append(r)

    def _plan(self, now: float) -> None:
        c = self.cost
        self._admit()
        self.version += 1
        if self.prefilling:
            tokens, enc, done = 0, 0.0, []
            for r in self.prefilling:
                take = min(r.pf_left, c.chunk_tokens - tokens)
                if take <= 0:
                    break
                if r.pf_left == r.prompt_total:  # its first chunk: it waited since routed here
                    waits = self.fleet.waits["lm"]
                    waits[0] += now - r.t_lm
                    waits[1] += 1
                if self.colocated and r.n_img and not r.encoded:
                    enc += c.colo_encode_s(r.n_img, r.n_img * r.img_tok)
                    r.encoded = True
                r.pf_left -= take
                tokens += take
                if not r.pf_left:
                    done.append(r)
            if done:
                self.prefilling = [r for r in self.prefilling if r.pf_left]
            self.just_prefilled = done
            self.mode = PREFILL
            dt = c.step_s + c.per_seq_s * (self.n_run + len(done)) + c.per_prefill_token_s * tokens + enc
            self.fleet.push(now + dt * self.fleet.slowdown, self._wake, self.version)
        elif self.n_run:
            self.mode = DECODE
            self.t0, self.dt = now, (c.step_s + c.per_seq_s * self.n_run) * self.fleet.slowdown
            self.k = self.finishing[0][0] - self.steps
            self.fleet.push(now + self.k * self.dt, self._wake, self.version)
        else:
            self.mode = IDLE
            if self.state == DRAINING:
                self.fleet.retire(self, now)

    def _wake(self, now: float, version: int) -> None:
        if version != self.version:
            return
        if self.mode == PREFILL:
            self.steps += 1
            for r in self.just_prefilled:
                r.t_first = now
                self.ttfts.append(now - r.t_lm)
                self.n_run += 1
                heapq.heappush(self.finishing, (self.steps + r.out - 1, r.i, r))
            self.just_prefilled = []
        else:
            self.steps += self.k
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.finishing)
            r.t_done = now
            if r.out > 1:
                self.tpots.append((now - r.t_first) / (r.out - 1))
            self.n_run -= 1
            self.kv_used -= r.kv
            self.fleet.finished += 1
        self._plan(now)

    def drain(self, now: float) -> list:
        """Stop taking work; finish what holds KV; hand back what waits (the fleet re-routes it)."""
        self.state = DRAINING
        left, self.waiting = list(self.waiting), deque()
        if self.mode == IDLE:
            self.fleet.retire(self, now)
        return left


@dataclass
class Result:
    t_arr: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    end_s: float
    gpu_s: float
    timeline: list = field(default_factory=list)  # (t, encoders active, LMs active, GPUs held)

    def met(self, slo_ttft_s: float, slo_tpot_s: float) -> np.ndarray:
        return (self.ttft <= slo_ttft_s) & (self.tpot <= slo_tpot_s)


class Fleet:
    """One simulation: ``Fleet(profile, ...).run(trace)``. ``autoscaler`` (``sim.autoscale``) is
    called every ``autoscaler.tick_s`` with the fleet and may ``add``/``drain`` instances within its
    GPU budget; a new instance is active ``provision_s`` after it is added. ``slowdown`` stretches every
    engine step and encoder batch (the CPU host's engines sharing their cores with the load generator)."""

    def __init__(self, profile: Profile, *, n_enc: int = 0, n_lm: int = 1, colocated: bool = False,
                 autoscaler=None, provision_s: float = 0.0, slowdown: float = 1.0):
        if colocated and n_enc:
            raise ValueError("a colocated fleet has no encoders")
        if n_lm < 1 or (not colocated and n_enc < 1):
            raise ValueError("a fleet needs an LM, and a split fleet an encoder")
        self.profile, self.colocated = profile, colocated
        self.autoscaler, self.provision_s = autoscaler, provision_s
        self.slowdown = slowdown
        self.events: list = []
        self.seq = 0
        self.encoders: list[Encoder] = []
        self.lms: list[LM] = []
        self.finished = 0
        self.held = 0
        self.gpu_s = 0.0
        self.t_held = 0.0
        self.waits = {"encoder": [0.0, 0], "lm": [0.0, 0]}  # queue seconds and count, ever (for the autoscaler)
        self.pending: list[str] = []  # roles added while the budget was full: started as GPUs free up
        self.timeline: list = []
        for _ in range(n_enc):
            self._new("encoder", 0.0, 0.0)
        for _ in range(n_lm):
            self._new("lm", 0.0, 0.0)

    # -- events ------------------------------------------------------------------------------------
    def push(self, t: float, fn, arg) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, arg))

    def run(self, trace: Trace) -> Result:
        n = len(trace)
        self.reqs = [Req(i, int(trace.prompt[i]), int(trace.n_img[i]), int(trace.img_tok[i]), int(trace.out[i]))
                     for i in range(n)]
        self.n = n
        for i in range(n):
            self.push(float(trace.t[i]), self._arrive, self.reqs[i])
        if self.autoscaler is not None:
            self.push(0.0, self._tick, None)
        now = 0.0
        while self.events:
            now, _, fn, arg = heapq.heappop(self.events)
            fn(now, arg)
        self._account(now)
        ttft = np.array([r.t_first for r in self.reqs]) - trace.t
        tpot = np.array([(r.t_done - r.t_first) / (r.out - 1) if r.out > 1 else 0.0 for r in self.reqs])
        return Result(trace.t.copy(), ttft, tpot, now, self.gpu_s, self.timeline)

    # -- the gateway -------------------------------------------------------------------------------
    def _arrive(self, now: float, req: Req) -> None:
        p = self.profile.path
        if not req.n_img:
            self.push(now + p.front_s, self._to_lm, req)
        elif self.colocated:
            self.push(now + p.front_s + p.preprocess_s, self._to_lm, req)
        else:
            self.push(now + p.front_s + p.meta_s + p.preprocess_s, self._to_encoders, req)

    def _to_encoders(self, now: float, req: Req) -> None:
        for _ in range(req.n_img):
            self._route_item((req, req.img_tok), now)

    def _route_item(self, item, now: float) -> None:
        live = [e for e in self.encoders if e.state == ACTIVE]
        min(live, key=lambda e: e.load).submit(item, now)

    def land(self, now: float, req: Req) -> None:
        req.items_left -= 1
        if not req.items_left:
            self._to_lm(now, req)

    def _to_lm(self, now: float, req: Req) -> None:
        live = [m for m in self.lms if m.state == ACTIVE]
        min(live, key=lambda m: m.load).submit(req, now)

    # -- instances and GPUs ------------------------------------------------------------------------
    def _account(self, now: float) -> None:
        self.gpu_s += self.held * (now - self.t_held)
        self.t_held = now

    def _new(self, role: str, now: float, delay: float) -> None:
        self._account(now)
        self.held += 1
        inst = Encoder(self, len(self.encoders)) if role == "encoder" else LM(self, len(self.lms), self.colocated)
        (self.encoders if role == "encoder" else self.lms).append(inst)
        if delay > 0:
            self.push(now + delay, self._activate, inst)
        else:
            inst.state = ACTIVE

    def _activate(self, now: float, inst) -> None:
        inst.state = ACTIVE

    def active(self, role: str) -> list:
        return [i for i in (self.encoders if role == "encoder" else self.lms) if i.state == ACTIVE]

    def add(self, role: str, now: float, budget: int) -> None:
        """A new instance of ``role`` (it joins after ``provision_s``), or once a GPU frees up."""
        if self.held < budget:
            self._new(role, now, self.provision_s)
        else:
            self.pending.append(role)

    def drain(self, role: str, now: float) -> None:
        """Drain the active instance of ``role`` that frees its GPU soonest (never the last one)."""
        live = self.active(role)
        if len(live) > 1:
            self.drain_instance(min(live, key=lambda i: i.drain_cost), now)

    def drain_instance(self, inst, now: float) -> None:
        """Drain ``inst``; re-route what it had not started."""
        if inst.state != ACTIVE or len(self.active("encoder" if isinstance(inst, Encoder) else "lm")) <= 1:
            return
        for item in inst.drain(now):
            if isinstance(inst, Encoder):
                self._route_item(item, now)
            else:
                self._to_lm(now, item)

    def retire(self, inst, now: float) -> None:
        inst.state = GONE
        self._account(now)
        self.held -= 1
        if self.pending:
            self._new(self.pending.pop(0), now, self.provision_s)

    def _tick(self, now: float, _) -> None:
        self._account(now)
        self.autoscaler.step(self, now)
        self.timeline.append((now, len(self.active("encoder")), len(self.active("lm")), self.held))
        if self.finished < self.n:
            self.push(now + self.autoscaler.tick_s, self._tick, None)
