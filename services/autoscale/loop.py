"""The local autoscaler (``epd up --autoscale``): every ``interval_s`` it scrapes each encoder's and LM's
internal metrics port (the scaling signals, services/encoder/signals.py and services/lm/signals.py), builds
a ``policy.Snapshot``, asks the ``policy.Policy`` what to do, and does it on the ``Deployment``
(``add_encoder``, ``add_lm``, ``remove``: the instance drains first).

Each signal is read over the last interval, from the change of a counter or histogram since the previous
scrape of that instance: an encoder's busy share (``epd_encoder_busy_seconds_total``) and the mean time its
items waited before their batch started (in front of the engine, ``epd_encoder_service_wait_seconds_total``
over ``epd_encoder_engine_requests_total``, plus in its engine's scheduler, ``vllm:request_queue_time_seconds``,
sum over count);
an LM's TTFT and TPOT p90 (``vllm:time_to_first_token_seconds`` and
``vllm:request_time_per_output_token_seconds``, interpolated in the buckets as Prometheus'
``histogram_quantile`` does). The first scrape of an instance gives no reading (nothing to subtract).

An action runs on its own thread (an engine takes tens of seconds to start, a drain up to its grace), so
scraping goes on meanwhile; while a role has an action in flight the policy is not asked about that role,
and its cool-down starts again when the action is done. An instance whose metrics port does not answer
yet (starting) or that drains is not counted as capacity. ``history`` keeps one sample per round (the
instance counts, each role's lateness, the gateway's objective attainment where it exports one) and
``events`` every action, for ``bench/autoscale.py``'s table and plot.

Owner: whoever makes an ``Autoscaler`` stops it (``stop``) before stopping the deployment; its threads
only call the deployment's own methods, which hold the deployment's lock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.autoscale.policy import ROLES, Action, Budget, InstanceSignals, Policy, Snapshot, role_lateness

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
QUEUE_TIME = "vllm:request_queue_time_seconds"
SERVICE_WAIT = "epd_encoder_service_wait_seconds_total"
STARTED = "epd_encoder_engine_requests_total"


def mean_change(m: dict[str, float], before: dict[str, float], total: str, count: str) -> float | None:
    """The mean of what ``total`` grew by per unit ``count`` grew by between two scrapes (None: no count)."""
    n = m.get(count, 0.0) - before.get(count, 0.0)
    return max(0.0, m.get(total, 0.0) - before.get(total, 0.0)) / n if n > 0 else None
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
QUANTILE = 0.9


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float] | None:
    """Every sample on ``host:port``'s /metrics, summed by sample name over labels; None when it does not
    answer. ``objective`` labels are kept apart (``name{objective="both"}``): they are shares, not sums; so
    are a histogram's ``le`` (``name_bucket{le="0.5"}``), summed over its other labels (engines)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            kept = next((k for k in ("objective", "le") if k in s.labels), None)
            name = s.name + (f'{{{kept}="{s.labels[kept]}"}}' if kept else "")
            out[name] = out.get(name, 0.0) + s.value
    return out


def buckets(m: dict[str, float], family: str) -> list[tuple[float, float]]:
    """``family``'s cumulative histogram buckets in a ``scrape``: (upper bound, count), by bound."""
    prefix = f'{family}_bucket{{le="'
    return sorted((float(k[len(prefix):-2]), v) for k, v in m.items() if k.startswith(prefix))


def histogram_quantile(q: float, now: list[tuple[float, float]], before: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of the observations between two scrapes of one histogram's buckets (``now`` less
    ``before``), interpolated linearly in its bucket as Prometheus does (past the last finite bound: that
    bound); None when nothing was observed in between."""
    old = dict(before)
    cum = [(le, max(0.0, c - old.get(le, 0.0))) for le, c in now]
    if not cum or cum[-1][1] <= 0:
        return None
    rank, lo, below = q * cum[-1][1], 0.0, 0.0
    for le, c in cum:
        if c >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / (c - below) if c > below else le
        lo, below = le, c
    return lo


def lm_slots(engine_args: str, lm_args: list[str] | None, default: int) -> int:
    """Each LM's ``max_num_seqs`` (the LM load is requests over it): ``epd up --lm-args --max-num-seqs N``,
    else ``--vllm-args``' ``max_num_seqs``, else ``default`` (``EngineConfig``'s)."""
    args = lm_args or []
    for i, a in enumerate(args):
        if a.startswith("--max-num-seqs="):
            return int(a.split("=", 1)[1])
        if a == "--max-num-seqs" and i + 1 < len(args):
            return int(args[i + 1])
    return int(json.loads(engine_args or "{}").get("max_num_seqs", default))


def tree_rss(pid: int) -> int:
    """Resident memory of a process and its descendants (its engines), in bytes; 0 once it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class Autoscaler:
    """Scales ``dep``'s encoders and LMs within ``budget`` (module docstring). ``lm_slots``: each LM's
    ``max_num_seqs`` (the engines' setting), only for the history's ``lm_held`` (requests held over it; the
    policy reads lateness, not this); ``start_timeout_s``: how long an added instance may take to be routed
    to before it is given up (stopped; the next round may try again)."""

    def __init__(self, dep, budget: Budget, interval_s: float = 2.0, lm_slots: int = 8,
                 start_timeout_s: float = 600.0) -> None:
        self.dep = dep
        self.budget = budget
        self.policy = Policy(budget)
        self.interval_s = interval_s
        self.lm_slots = lm_slots
        self.start_timeout_s = start_timeout_s
        self.history: list[dict] = []
        self.events: list[dict] = []
        self._seen: dict[str, tuple[float, dict[str, float]]] = {}  # address -> (time, its last scrape)
        self._last: dict[str, InstanceSignals] = {}  # address -> its last signals (a scrape that times out)
        self._held: dict[str, float] = {}  # LM address -> requests running and waiting at its last scrape
        self._acting: dict[str, list[Future]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2 * len(ROLES), thread_name_prefix="epd-autoscale-act")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    def start(self) -> Autoscaler:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="epd-autoscale", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops deciding; waits for the actions in flight (a starting instance finishes starting)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.round()
            except Exception:
                logger.exception("autoscaler round failed")

    def snapshot(self) -> Snapshot:
        """Each serving encoder's and LM's signals (one that drains is marked so; one that never answered is
        starting and left out; one alive that answered before and not now, a scrape that timed out on a busy
        host, keeps its last signals: it is not gone)."""
        encoders, lms, leaving = self.dep.members()
        snap = Snapshot()
        now = time.monotonic()
        for role, services in (("encoder", encoders), ("lm", lms)):
            for svc in services:
                m = scrape(svc.metrics_port) if svc.alive() else None
                if m is None:
                    if svc.alive() and svc.address in self._last:
                        snap.of(role).append(self._last[svc.address])
                    continue
                inst = InstanceSignals(svc.address, draining=svc in leaving or m.get("epd_instance_draining", 0) > 0,
                                       # a process-tree walk, only where a memory budget reads it
                                       memory_bytes=tree_rss(svc.proc.pid) if self.budget.max_memory_gib else 0)
                t_before, before = self._seen.get(svc.address, (now, None))
                if before is not None:
                    self._read(role, inst, m, before, now - t_before)
                if role == "lm":
                    self._held[svc.address] = m.get("vllm:num_requests_running", 0.0) + m.get(
                        "vllm:num_requests_waiting", 0.0)
                self._seen[svc.address] = (now, m)
                snap.of(role).append(inst)
                self._last[svc.address] = inst
        members = {svc.address for svc in (*encoders, *lms)}
        for table in (self._seen, self._last, self._held):  # an instance gone is forgotten: bounded by the fleet
            for address in table.keys() - members:
                del table[address]
        return snap

    @staticmethod
    def _read(role: str, inst: InstanceSignals, m: dict[str, float], before: dict[str, float], dt: float) -> None:
        """``inst``'s signals over the ``dt`` seconds between two scrapes, ``before`` and ``m``."""
        if role == "encoder":
            if dt > 0:
                busy = m.get("epd_encoder_busy_seconds_total", 0.0) - before.get("epd_encoder_busy_seconds_total", 0.0)
                inst.busy = min(1.0, max(0.0, busy / dt))
            # The time an item waited before its batch started: in front of the engine (this service's own
            # wait), then in the engine's scheduler (vLLM's queue time); each a mean over the interval.
            waits = [mean_change(m, before, f"{QUEUE_TIME}_sum", f"{QUEUE_TIME}_count"),
                     mean_change(m, before, SERVICE_WAIT, STARTED)]
            if any(w is not None for w in waits):
                inst.queue_wait_s = sum(w or 0.0 for w in waits)
            return
        inst.ttft_s = histogram_quantile(QUANTILE, buckets(m, TTFT), buckets(before, TTFT))
        inst.tpot_s = histogram_quantile(QUANTILE, buckets(m, TPOT), buckets(before, TPOT))

    def round(self) -> list[Action]:
        """One scrape and decision; starts the actions it decided."""
        snap = self.snapshot()
        now = time.monotonic()
        for role, futs in list(self._acting.items()):
            if all(f.done() for f in futs):
                del self._acting[role]
                self.policy.changed(role, now)  # the cool-down counts from when the change is done
        actions = self.policy.decide(snap, now, skip=frozenset(self._acting))
        gateway = scrape(self.dep.gateway_metrics) or {}
        lms = [i for i in snap.lms if not i.draining]
        self.history.append({
            "t": round(now - self.t0, 2),
            "encoders": sum(not i.draining for i in snap.encoders), "lms": len(lms),
            "encoder_lateness": role_lateness("encoder", snap, self.budget),
            "lm_lateness": role_lateness("lm", snap, self.budget),
            "lm_held": sum(self._held.get(i.address, 0.0) for i in lms) / (len(lms) * self.lm_slots) if lms else None,
            "attainment": gateway.get('epd_gateway_objective_attainment{objective="both"}'),
        })
        for action in actions:
            logger.info("autoscaler: %s %s%s%s (%s)", action.kind, action.role,
                        f" x{action.count}" if action.count > 1 else "",
                        f" {action.address}" if action.address else "", action.reason)
            self._acting.setdefault(action.role, []).append(self._pool.submit(self._act, action))
        return actions

    def _act(self, action: Action) -> None:
        started = time.monotonic()
        event = {"t": round(started - self.t0, 2), "kind": action.kind, "role": action.role,
                 "address": action.address, "reason": action.reason}
        try:
            if action.kind == "add":
                add = self.dep.add_encoder if action.role == "encoder" else self.dep.add_lm
                event["address"] = ",".join(add(timeout=self.start_timeout_s).address for _ in range(action.count))
            else:
                encoders, lms, _ = self.dep.members()  # copies, under the deployment's lock
                svc = next((s for s in [*encoders, *lms] if s.address == action.address), None)
                if svc is not None:
                    event["drained"] = self.dep.remove(svc)
            event["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported in the events and the log; the next round goes on
            logger.warning("autoscaler: %s %s failed: %s", action.kind, action.role, e)
            event.update(ok=False, error=str(e)[:500])
        event["took_s"] = round(time.monotonic() - started, 2)
        self.events.append(event)
