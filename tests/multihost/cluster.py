"""One epd-serve deployment spread over the hosts of ``hosts.Network``, and a
client on its own host that drives it the way a remote user would.

Hosts (each its own network namespace, address and /dev/shm):

    enc1  encoder          } one pod: they share /dev/shm, each has its own network
    lm1   LM               }
    enc2  encoder
    lm2   LM
    gw    three gateways: "dns"   --encoders encoders.epd:PORT --lms lms.epd:PORT (names that
                                  this host's /etc/hosts resolves to both instances of the role)
                          "three" enc2 + lm2 only (encoder, LM and gateway on three hosts)
                          "pod"   enc1 + lm1 only (the pod: shared /dev/shm)
    client  the tests' HTTP and gRPC calls (``Client``), never the root namespace

Every internal link runs mutual TLS plus the shared token; the certificate is
valid for every address and name above. Ports are fixed: each host has its own
port space.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from peerauth import SecurityConfig
from services.certs import make_certs, make_token
from services.up import Service, split_cores, wait_ready
from tests.multihost.hosts import Host, Network

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENC_PORT, TRANSFER_PORT, ENC_METRICS = 50051, 50052, 9101
LM_PORT, LM_METRICS = 50061, 9102
GATEWAY_PORTS = {"dns": 8000, "three": 8001, "pod": 8002}
ENCODERS_NAME, LMS_NAME = "encoders.epd", "lms.epd"
NIXL_ENCODER_TRANSPORTS = "shm,grpc,nixl"  # enc2's: what auto resolves to on CPU, and NIXL for an LM that asks

# Bounds the fault tests rely on (and state): an LM gives up on a silent encoder after
# TRANSFER_TIMEOUT_S, a gateway on an Encode after ENCODE_TIMEOUT_S; an unacked encoder
# output is freed after LEASE_S.
TRANSFER_TIMEOUT_S = 10.0
ENCODE_TIMEOUT_S = 10.0
LEASE_S = 15.0


@dataclass
class Client:
    """Runs ``tests.multihost.client`` inside the client host, one process per call."""

    host: Host
    security: SecurityConfig

    def _run(self, *args: str, stdin: bytes | None = None, timeout: float = 180) -> dict:
        env = dict(os.environ, EPD_MH_SECURITY=json.dumps(self.security.to_dict()), PYTHONPATH=ROOT)
        proc = subprocess.run(self.host.wrap([sys.executable, "-m", "tests.multihost.client", *args]),
                              input=stdin, capture_output=True, check=False, timeout=timeout, env=env, cwd=ROOT)
        lines = proc.stdout.decode(errors="replace").strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"client {args[0]} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
        return json.loads(lines[-1])

    def post(self, url: str, body: dict, timeout: float = 120) -> tuple[int, dict, float]:
        out = self._run("post", url, str(timeout), stdin=json.dumps(body).encode(), timeout=timeout + 60)
        return out["status"], out["body"], out["elapsed_s"]

    def get(self, url: str) -> tuple[int, str]:
        out = self._run("get", url)
        return out["status"], out["text"]

    def health(self, address: str) -> bool:
        return bool(self._run("health", address, timeout=60).get("serving"))

    def stats(self, encoder_addr: str) -> dict[str, float]:
        """The encoder's live Transfer ``Stats`` (outbound pool and reservations)."""
        out = self._run("stats", encoder_addr, timeout=120)
        if "error" in out:
            raise RuntimeError(f"Stats of {encoder_addr}: {out['error']}")
        return out["values"]

    def metric(self, url: str, name: str, *, required: bool = False, **labels: str) -> float:
        """Sum of the samples of ``name`` at a /metrics ``url`` whose labels include ``labels``
        (0 when there is none, or AssertionError with ``required``)."""
        status, text = self.get(url)
        if status != 200:
            raise RuntimeError(f"{url}: {status} {text[:300]}")
        total, found = 0.0, False
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
                found = True
        assert found or not required, f"{url} has no sample of {name} {labels}"
        return total


def logged_ready(svc: Service) -> bool:
    """Whether the service has logged its "<role> ready: api ..." line (``encoder/server.py``, ``lm/server.py``)."""
    try:
        with open(svc.log_path, errors="replace") as f:
            return any(" ready: api " in line for line in f)
    except OSError:
        return False


@dataclass
class Cluster:
    net: Network
    model: str
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="epd-multihost-"))
    services: dict[str, Service] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.net
        self.enc1 = n.add_host("enc1")
        self.lm1 = n.add_host("lm1", shm_with=self.enc1)
        self.enc2 = n.add_host("enc2")
        self.lm2 = n.add_host("lm2")
        self.gw = n.add_host("gw")
        self.client_host = n.add_host("client")
        self.encoder_hosts, self.lm_hosts = [self.enc1, self.enc2], [self.lm1, self.lm2]
        self.set_names([self.enc1, self.enc2], [self.lm1, self.lm2])

        names = ["localhost", "127.0.0.1", ENCODERS_NAME, LMS_NAME, *(h.ip for h in n.hosts.values())]
        sec = make_certs(os.path.join(self.log_dir, "tls"), names)
        sec["auth_token_file"] = make_token(os.path.join(self.log_dir, "auth-token"))
        self.security = SecurityConfig(**sec)
        self.client = Client(self.client_host, self.security)
        sec_args = [a for k, v in sec.items() for a in ("--" + k.replace("_", "-"), v)]
        enc_cores, lm_cores = split_cores()
        common = ["--model", self.model, *sec_args]
        for h in self.encoder_hosts:
            # enc2 offers NIXL too, to an LM that asks for it (``use_nixl``); the LMs' ``auto`` never does.
            nixl = ["--transports", NIXL_ENCODER_TRANSPORTS] if h is self.enc2 else []
            self._service(h.name, h, ["encoder", "--host", h.ip, "--port", str(ENC_PORT), "--transfer-host", h.ip,
                                      "--advertise-host", h.ip, "--transfer-port", str(TRANSFER_PORT),
                                      "--metrics-port", str(ENC_METRICS), "--metrics-host", h.ip,
                                      "--cpu-cores", enc_cores, "--lease-s", str(LEASE_S), *nixl, *common])
        for h in self.lm_hosts:
            self._service(h.name, h, ["lm", "--host", h.ip, "--port", str(LM_PORT), "--metrics-port", str(LM_METRICS),
                                      "--metrics-host", h.ip, "--cpu-cores", lm_cores,
                                      "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), *common])
        targets = {"dns": (f"{ENCODERS_NAME}:{ENC_PORT}", f"{LMS_NAME}:{LM_PORT}"),
                   "three": (self.encoder_addr(self.enc2), self.lm_addr(self.lm2)),
                   "pod": (self.encoder_addr(self.enc1), self.lm_addr(self.lm1))}
        for gname, (encs, lms) in targets.items():
            self._service(f"gw-{gname}", self.gw, [
                "gateway", "--epd-facts", "--host", self.gw.ip, "--port", str(GATEWAY_PORTS[gname]), "--encoders", encs,
                # Checks every 2 s (timeout 2 s): a gateway starved for a moment on a loaded 2-core host
                # must not eject every instance at once; names are re-resolved on that tick.
                "--lms", lms, "--health-interval-s", "2", "--dns-refresh-s", "1",
                "--encode-timeout-s", str(ENCODE_TIMEOUT_S), *sec_args])

    # -- addresses -------------------------------------------------------------

    @staticmethod
    def encoder_addr(h: Host) -> str:
        return f"{h.ip}:{ENC_PORT}"

    @staticmethod
    def transfer_addr(h: Host) -> str:
        return f"{h.ip}:{TRANSFER_PORT}"

    @staticmethod
    def lm_addr(h: Host) -> str:
        return f"{h.ip}:{LM_PORT}"

    @staticmethod
    def metrics_url(h: Host) -> str:
        """A service's metrics port, on its host's address: HTTPS, read with the deployment's client
        certificate and token (``client.get``)."""
        return f"https://{h.ip}:{ENC_METRICS if h.name.startswith('enc') else LM_METRICS}/metrics"

    def url(self, gateway: str) -> str:
        return f"http://{self.gw.ip}:{GATEWAY_PORTS[gateway]}"

    def set_names(self, encoders: list[Host], lms: list[Host]) -> None:
        """What ``encoders.epd`` and ``lms.epd`` resolve to in the gateway host."""
        self.gw.set_hosts({ENCODERS_NAME: [h.ip for h in encoders], LMS_NAME: [h.ip for h in lms]})

    # -- lifecycle -------------------------------------------------------------

    def _service(self, name: str, host: Host, args: list[str]) -> None:
        argv = host.wrap([sys.executable, "-m", "services.cli", *args])
        self.services[name] = Service(name, args, os.path.join(self.log_dir, f"{name}.log"), command=argv)

    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)

    def start(self, timeout: float = 300) -> Cluster:
        t0 = time.monotonic()
        engines = {s: self.services[s] for s in ("enc1", "enc2", "lm1", "lm2")}
        for svc in engines.values():
            svc.start(self.env())
        addr = {"enc1": self.encoder_addr(self.enc1), "enc2": self.encoder_addr(self.enc2),
                "lm1": self.lm_addr(self.lm1), "lm2": self.lm_addr(self.lm2)}
        # Health checks from the client host: readiness, and the bridge carries traffic. Each check is
        # a process in the client host (interpreter, grpc, TLS), so none is made before the service has
        # logged that it is ready: polling from the first second cost the starting engines a core.
        wait_ready({svc: (lambda a=addr[n], s=svc: logged_ready(s) and self.client.health(a))
                    for n, svc in engines.items()}, t0 + timeout, poll_s=1.0)
        gateways = [s for n, s in self.services.items() if n.startswith("gw-")]
        for svc in gateways:
            svc.start(self.env())
        wait_ready({svc: (lambda g=n[3:]: self.client.get(self.url(g) + "/health")[0] == 200)
                    for n, svc in self.services.items() if n.startswith("gw-")}, t0 + timeout, poll_s=0.5)
        # Ready is not admitted: a request posted before its gateway admits the encoder would be
        # encoded by the LM itself.
        for gname, (encs, lms) in {"three": ([self.enc2], [self.lm2]), "pod": ([self.enc1], [self.lm1]),
                                   "dns": (self.encoder_hosts, self.lm_hosts)}.items():
            self.wait_admitted(gname, encs, lms, timeout=max(60.0, t0 + timeout - time.monotonic()))
        return self

    def use_nixl(self, lm: Host, timeout: float = 300) -> None:
        """Restarts ``lm`` with ``--transports nixl`` and UCX held to TCP (UCX would otherwise find
        the encoder's process on this machine and read it by CMA): its embeddings are READ over the
        network, and it says so in the answer's facts. The LM stays so until the cluster stops."""
        svc = self.services[lm.name]
        svc.stop()
        args = [*svc.args, "--transports", "nixl"]
        argv = lm.wrap([sys.executable, "-m", "services.cli", *args])
        self.services[lm.name] = new = Service(lm.name, args, svc.log_path, command=argv)
        new.start({**self.env(), "UCX_TLS": "tcp"})
        wait_ready({new: lambda: logged_ready(new) and self.client.health(self.lm_addr(lm))},
                   time.monotonic() + timeout, poll_s=1.0)

    def restart(self, name: str) -> None:
        svc = self.services[name]
        if svc.alive():
            svc.stop()
        svc.start(self.env())

    def stop(self) -> None:
        services = list(self.services.values())
        with ThreadPoolExecutor(len(services) or 1) as pool:  # in parallel: each may wait its SIGTERM grace
            list(pool.map(lambda s: s.stop(grace=10), services))

    def logs(self, *names: str) -> str:
        return "\n".join(f"--- {n} ---\n{self.services[n].log_tail(40)}" for n in names or self.services)

    # -- what the scenarios read -------------------------------------------------

    def health(self, gateway: str) -> dict:
        """The gateway's /health body: ``{"lms": {addr: admitted}, "encoders": {...}, ...}``."""
        status, text = self.client.get(self.url(gateway) + "/health")
        return json.loads(text) if text.startswith("{") else {"status": status, "text": text}

    def wait_admitted(self, gateway: str, encoders: list[Host], lms: list[Host], timeout: float) -> dict:
        """Waits until the gateway's instances are exactly these hosts, all admitted; returns /health."""
        want = {"encoders": {self.encoder_addr(h): True for h in encoders},
                "lms": {self.lm_addr(h): True for h in lms}}
        deadline = time.monotonic() + timeout
        while True:
            h = self.health(gateway)
            if {k: h.get(k) for k in want} == want:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"{gateway} gateway: want {want}, has {h}")
            time.sleep(0.3)

    def affine(self, body: dict, encoders: list[Host]) -> Host:
        """The encoder the gateway's routing sends this request's image to, among ``encoders``."""
        from types import SimpleNamespace

        from services.common.media import content_id
        from services.gateway.routing import pick_encoder
        from tests.e2e.helpers import image_bytes

        fakes = [SimpleNamespace(address=self.encoder_addr(h), outstanding=0) for h in encoders]
        return encoders[fakes.index(pick_encoder(content_id(image_bytes(body)), fakes, spill=4))]

    def reservations(self) -> dict[str, dict[str, float]]:
        """Reservations and held items on every side that is up: each live encoder's Transfer
        ``Stats`` and each live LM's consumer gauges (``epd_ec_*{role="consumer"}``)."""
        out: dict[str, dict[str, float]] = {}
        for h in self.encoder_hosts:
            if self.services[h.name].alive():
                v = self.client.stats(self.encoder_addr(h))
                out[h.name] = {k: v.get(k, -1) for k in ("pending_reservations", "reserved_bytes", "items_held")}
        for h in self.lm_hosts:
            if self.services[h.name].alive():
                out[h.name] = {k: self.client.metric(self.metrics_url(h), f"epd_ec_{k}", required=True, role="consumer")
                               for k in ("pending_reservations", "reserved_bytes")}
        return out

    def wait_no_reservations(self, timeout: float) -> dict:
        """Waits until no side holds a reservation or an unacked item; fails with what is held."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.reservations()
            if all(v == 0 for side in held.values() for v in side.values()):
                return held
            if time.monotonic() > deadline:
                raise AssertionError(f"still held after {timeout:.0f}s: {held}")
            time.sleep(1.0)
