"""Gateway processes a test adds in front of a running deployment's encoders and LMs (no engine of their
own, so they cost a process start each): ``ExtraGateway`` (one ``epd gateway``, or a supervisor with
``--workers``) and ``Replicas`` (two replicas sharing a private state store, one state secret and one
keys file, as two hosts of one front door would).

Who owns what: ``Replicas`` starts the store (``tests.integration.redis_fixture.started_store``), writes
the keys file and the secret in its directory, and stops every gateway it started and then the store on
exit; a test may stop the store earlier (``store.stop(remove=False)``: the directory stays until the
exit). An ``ExtraGateway`` is a ``services.child.Service`` in a session of its own: ``stop`` ends it with
whatever it started (a supervisor's workers and private store), ``kill`` is ``kill -9`` on that session.

Every extra gateway gets the deployment's own security flags (``Deployment.security_args``: the token
file, and the TLS files when the deployment has them), as the deployment's gateway does, and
``--epd-facts`` (the ``epd`` object names the LM that answered). Every wait is a poll with a generous
deadline: nothing here times how fast a process is."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from services.child import Service, free_port, wait_ready
from services.common.spawn import child_env
from services.probe import gateway_admitted
from services.up import Deployment
from tests.e2e.helpers import metric
from tests.integration.gateway_processes import call_json
from tests.integration.redis_fixture import started_store

DEADLINE_S = 120.0
"""The longest a gateway is waited for to admit its instances: a hang guard, never a measure."""
LEASE_S = 10.0
"""The replicas' --state-store-lease-s: a killed replica's places come back within it of its last heartbeat.
Longer than the 6 s default, so that a live replica's heartbeat (every third of it) delayed on a loaded
host never lets its places go."""
TENANTS = {"alice": {"max_in_flight": 1}, "bob": {}, "carol": {}}
"""The replicas' tenants (key ``sk-<name>``): alice has one place in flight across the front door."""


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{tenant}"}


class ExtraGateway:
    """``epd gateway`` with ``args`` in front of ``encoders`` and all of ``dep``'s LMs (default: all its
    encoders), on loopback ports of its own: ``port`` (REST), ``metrics_port`` (internal /metrics)."""

    def __init__(self, dep: Deployment, log_dir: Path, name: str, args: list[str],
                 encoders: list[str] | None = None) -> None:
        self.encoders = [e.address for e in dep.encoders] if encoders is None else encoders
        self.lms = [lm.address for lm in dep.lms]
        self.port, self.metrics_port = free_port(), free_port()
        self.service = Service(name, ["gateway", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--metrics-port", str(self.metrics_port), "--encoders", ",".join(self.encoders),
                                      "--lms", ",".join(self.lms), *dep.security_args, "--epd-facts", *args],
                               str(log_dir / f"{name}.log"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ExtraGateway:
        self.service.start(child_env({"PYTHONUNBUFFERED": "1"}))
        return self

    def wait_ready(self) -> ExtraGateway:
        """Returns once it has admitted every encoder and LM it was given; raises if it exits first."""
        wait_ready({self.service: self.admitted}, time.monotonic() + DEADLINE_S)
        return self

    def admitted(self) -> bool:
        return gateway_admitted(self.url, self.encoders, self.lms,
                                metrics_url=f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self) -> None:
        self.service.stop()

    def kill(self) -> None:
        """``kill -9`` on its whole session (no cleanup, no goodbye to the store)."""
        try:
            os.killpg(self.service.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.service.proc.wait()

    def call(self, method: str, path: str, body: dict | None = None, tenant: str = "",
             timeout: float = DEADLINE_S) -> tuple[int, Any]:
        """One request on a new connection, as ``tenant`` (none: no key); (status, JSON or text)."""
        return call_json(http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout), method, path, body,
                         bearer(tenant) if tenant else {})

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_port, name, **labels)


class Replicas:
    """Two ``epd gateway`` replicas (indexes 0 and 1) in front of ``dep``'s first encoder and all its LMs,
    sharing a private store (``--state-store``, lease ``LEASE_S``), one ``--state-secret-file`` and one
    ``--api-keys-file`` (``TENANTS``), each with ``--lm-max-outstanding 2``. ``live(i)`` is replica ``i``,
    started again if it was killed; ``restart(i)`` kills it with ``kill -9`` and starts a new one."""

    def __init__(self, dep: Deployment, log_dir: Path) -> None:
        self.dep, self.log_dir = dep, log_dir
        self.keys, self.secret = log_dir / "keys.jsonl", log_dir / "state-secret"
        self.store = None
        self.gateways: list[ExtraGateway] = []
        self._starts = 0

    def __enter__(self) -> Replicas:
        self.keys.write_text("".join(json.dumps({"tenant": t, "key": f"sk-{t}", **quota}) + "\n"
                                     for t, quota in TENANTS.items()))
        self.secret.write_text(os.urandom(32).hex() + "\n")
        self.store = started_store()
        try:
            self.gateways = [self._replica(i).start() for i in range(2)]  # both start at once
            for gw in self.gateways:
                gw.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for gw in self.gateways:
            gw.stop()
        self.store.stop()

    def _replica(self, index: int) -> ExtraGateway:
        self._starts += 1
        args = ["--api-keys-file", str(self.keys), "--state-secret-file", str(self.secret),
                "--state-store", self.store.url, "--state-store-password-file", self.store.password_file,
                "--state-store-replicas", "2", "--state-store-replica", str(index),
                "--state-store-lease-s", str(LEASE_S), "--lm-max-outstanding", "2",
                # checks every 3 s (ejected after two timeouts in a row): an encoder a test freezes for a
                # moment stays admitted
                "--health-interval-s", "3",
                # a request past its replica's part waits (the store stopped) until the store is back
                "--admission-wait-s", "300"]
        return ExtraGateway(self.dep, self.log_dir, f"replica{index}-{self._starts}", args,
                            encoders=[self.dep.encoders[0].address])

    def live(self, index: int) -> ExtraGateway:
        if not self.gateways[index].service.alive():
            self.gateways[index] = self._replica(index).start().wait_ready()
        return self.gateways[index]

    def restart(self, index: int) -> ExtraGateway:
        self.gateways[index].kill()
        return self.live(index)
