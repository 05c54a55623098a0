"""The elastic half of ``services.up.Deployment``: instances that join and leave while the deployment
serves. ``add_encoder``/``add_lm`` start one more instance on its role's cores and return once the gateway
routes to it; ``remove`` lets one go (SIGTERM: it drains within its ``--drain-grace-s``, then what is left
of it is killed); ``exited`` takes out those that exited by themselves. The gateway learns of every change
from its ``--fleet-file``, which ``_write_fleet`` replaces atomically.

Owner: ``Deployment`` inherits this; the lists (``encoders``, ``lms``, ``services``), the fleet file and
``_leaving`` are the deployment's, changed only under its ``_lock`` (the autoscaler's threads call these
methods beside ``run_up``'s loop).
"""

from __future__ import annotations

import functools
import sys
import threading
import time

from ectransfer.shm import cleanup_orphans
from services.child import Service, wait_ready
from services.gateway.fleet_file import write_fleet_file
from services.probe import gateway_admitted, grpc_serving

SHUTDOWN_MARGIN_S = 15.0
"""What an encoder or LM told to stop may take past its ``--drain-grace-s`` (its engine's and server's
shutdown) before it is killed: ``Deployment.stop`` and ``remove``."""


class Elastic:
    """What ``Deployment`` provides: ``encoders``, ``lms``, ``n_encoders``/``n_lms`` (how many it started), ``services`` (the gateway last), ``with_encoder``,
    ``enc_cores``/``lm_cores``, ``encoder_args``/``lm_args`` and ``_common`` (every engine's flags),
    ``drain_grace_s``, ``gateway_metrics``, ``url``, ``client_security``, ``fleet_file``, and ``_service``,
    ``_envs``, ``_wait``, ``_say``. ``_elastic_init`` sets up the lock and counters."""

    def _elastic_init(self) -> None:
        self._lock = threading.RLock()  # the instance lists and the fleet file: the autoscaler's thread too
        self._added = {"encoder": 0, "lm": 0}
        self._leaving: set[Service] = set()

    def _write_fleet(self) -> None:
        with self._lock:
            write_fleet_file(self.fleet_file, [e.address for e in self.encoders] if self.with_encoder else None,
                             [lm.address for lm in self.lms])

    def add_encoder(self, timeout: float = 300.0) -> Service:
        """Starts one more encoder (on the encoders' cores) and returns it once the gateway has admitted it
        (``wait_admitted``): it is in the fleet file from its start, so the gateway checks it every health round and
        routes to it within one round of its SERVING. Raises as ``wait_ready`` does (the new one stopped)."""
        if not self.with_encoder:
            raise ValueError("this deployment has no encoders (its LMs encode media themselves)")
        return self._add("encoder", ["--transfer-host", self.host, "--cpu-cores", self.enc_cores, *self._common,
                                     *self.encoder_args], timeout)

    def add_lm(self, timeout: float = 300.0) -> Service:
        """Starts one more LM (one that prefills and decodes, on the LMs' cores); as ``add_encoder``."""
        return self._add("lm", ["--cpu-cores", self.lm_cores, *self._common, *self.lm_args], timeout)

    def _add(self, role: str, args: list[str], timeout: float) -> Service:
        with self._lock:
            # Named role + index after the started ones, one more each time: never a name (a log) taken before.
            n = (self.n_encoders if role == "encoder" else self.n_lms) + self._added[role]
            self._added[role] += 1
            svc = self._service(role, n, 2, args)
            svc.start(self._envs()[1])
            (self.encoders if role == "encoder" else self.lms).append(svc)
            self.services.insert(-1, svc)  # the gateway stays last
            self._write_fleet()
        t0 = time.monotonic()
        try:
            self._wait({svc: functools.partial(grpc_serving, svc.address, security=self.client_security)}, t0, timeout)
            self.wait_admitted(svc, t0 + timeout)
        except BaseException:
            self.remove(svc, grace=0)
            raise
        self._say(f"  {svc.name} joined ({time.monotonic() - t0:.0f}s)")
        return svc

    def wait_admitted(self, svc: Service, deadline: float) -> None:
        """Returns once the gateway routes to ``svc``; TimeoutError at ``deadline`` (monotonic)."""
        role = "encoder" if svc in self.encoders else "lm"
        url = f"http://127.0.0.1:{self.gateway_metrics}/metrics"
        wait_ready({svc: lambda: gateway_admitted(self.url, [svc.address] if role == "encoder" else [],
                                                  [svc.address] if role == "lm" else [], metrics_url=url)},
                   deadline, poll_s=0.2)

    def remove(self, svc: Service, grace: float | None = None) -> bool:
        """Lets ``svc`` (an encoder or LM of this deployment) go: SIGTERM (it turns NOT_SERVING, the gateway
        routes it nothing new, it finishes what it holds within its drain grace and stops its engine), a
        wait of ``grace`` (default: the drain grace plus a margin for the engine's shutdown), then SIGKILL for
        what is left of it; then it leaves the fleet file and its orphaned shared memory is removed. True
        when it exited by itself. Never the last LM: ValueError."""
        with self._lock:
            if svc in self.lms and len(self.lms) == 1:
                raise ValueError("the last LM cannot be removed (the deployment would serve nothing)")
            if svc not in self.encoders and svc not in self.lms:
                raise ValueError(f"{svc.name} is not an encoder or LM of this deployment")
            self._leaving.add(svc)  # not reported by exited() while it goes
        svc.terminate()
        svc.finish(time.monotonic() + (self.drain_grace_s + SHUTDOWN_MARGIN_S if grace is None else grace))
        clean = svc.proc is not None and svc.proc.returncode == 0
        self._forget(svc)
        self._say(f"  {svc.name} left ({'drained' if clean else 'killed'})")
        return clean

    def members(self) -> tuple[list[Service], list[Service], set[Service]]:
        """Copies of the encoders, the LMs, and those of them that are leaving (``remove`` in progress)."""
        with self._lock:
            return list(self.encoders), list(self.lms), set(self._leaving)

    def _forget(self, svc: Service) -> None:
        """Drops an instance that is gone from the lists and the fleet file, and its shared memory."""
        with self._lock:
            for group in (self.encoders, self.lms, self.services):
                if svc in group:
                    group.remove(svc)
            self._leaving.discard(svc)
            self._write_fleet()
        cleanup_orphans()

    def exited(self) -> list[Service]:
        """Encoders and LMs that exited by themselves since the last call (each taken out of the fleet: the
        others keep serving). ``run_up`` calls it; the gateway's own exit is ``gateway.alive()``."""
        with self._lock:
            gone = [svc for svc in [*self.encoders, *self.lms] if not svc.alive() and svc not in self._leaving]
        for svc in gone:
            svc.finish(time.monotonic())  # reaps it and kills what is left of its session
            self._forget(svc)
        return gone


def watch(dep, stop: dict) -> int:
    """``epd up``'s wait until ``stop["now"]`` (a signal): 0; 1 once the gateway exited. An encoder or LM that
    exits is logged and taken out of the fleet (``Deployment.exited``); the others keep serving."""
    while not stop["now"]:
        if not dep.gateway.alive():
            print(f"gateway exited unexpectedly:\n{dep.gateway.log_tail()}", file=sys.stderr)
            return 1
        for svc in dep.exited():  # the autoscaler, where it runs, may start another
            print(f"{svc.name} exited unexpectedly (the others keep serving):\n{svc.log_tail()}",
                  file=sys.stderr, flush=True)
        time.sleep(0.5)
    return 0
