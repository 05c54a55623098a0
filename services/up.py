"""``epd up``: one encoder, one LM and the gateway on this machine.

``Deployment`` starts the three services as subprocesses (each in its own
session, so its vLLM engine processes go down with it), shows progress until
each is ready, and stops them on ``stop()``: the gateway first, then the
encoders and LMs together (SIGTERM, then SIGKILL after a grace period). Shared-memory segments left by a killed child are
removed at the end. The e2e tests and the demo use the same class.

The fleet is elastic: ``add_encoder``/``add_lm`` start one more instance and ``remove`` lets one go
(SIGTERM: it drains within ``--drain-grace-s``, then it is killed if still there). The gateway learns of
both from its ``--fleet-file`` (``services.gateway.fleet_file``), which the deployment rewrites atomically
on every change. ``run_up`` keeps serving when an encoder or LM exits (only the gateway's exit ends it), and
with ``--autoscale`` runs the local autoscaler (``services.autoscale``) on the deployment.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ectransfer.shm import cleanup_orphans
from peerauth import SecurityConfig, is_loopback
from services.certs import make_certs, make_token
from services.child import Service, free_port, wait_ready
from services.common.engine import EngineConfig, configure_process_env, encoder_apart_verified, is_encoder_decoder
from services.common.spawn import child_env
from services.gateway.config import API_KEYS_ENV
from services.probe import gateway_admitted, grpc_serving
from services.startup_errors import check_model, check_port, explain
from services.up_elastic import SHUTDOWN_MARGIN_S, Elastic, watch

KV_HOST = "127.0.0.1"
"""Where ``epd up``'s prefill and decode LMs bind NIXL's side channel: they all run on this host."""


def split_cores(within: str = "") -> tuple[str, str]:
    """Disjoint core sets for the encoder and the LM engine on a CPU host (vLLM's
    CPU worker pins its whole process, so two engines on the same cores starve
    each other's side threads). The LM gets the larger half. ``within``: split
    that list ("2,3") instead of this process's cores; one core is shared."""
    cores = [int(c) for c in within.split(",")] if within else sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return within, within
    k = max(1, len(cores) // 2)
    fmt = lambda cs: ",".join(map(str, cs))  # noqa: E731
    return fmt(cores[:k]), fmt(cores[k:])


def pd_cores(enc_cores: str, lm_cores: str) -> tuple[str, str]:
    """Cores for the prefill and the decode LMs: the LM half split between them; where it is one core, the
    decode LM keeps it and the prefill LM shares the encoder's (prefill and encode are both work before a
    request's first token; decode steps are what a long prompt must not stall)."""
    if "," in lm_cores:
        return split_cores(lm_cores)
    return enc_cores or lm_cores, lm_cores


def check_security(host: str, security: str, insecure: bool) -> str:
    """``epd up``'s ``--security`` for ``host``, resolved ("auto": token on a loopback host, tls on any
    other). Raises ValueError for one every service would refuse (``SecurityConfig.require_for``)."""
    if security == "auto":
        security = "token" if is_loopback(host) else "tls"
    if security not in ("token", "tls", "none"):
        raise ValueError(f"security must be auto, token, tls or none; got {security!r}")
    if security != "tls" and not (is_loopback(host) or insecure):
        # Every service would refuse to start: say so before starting any.
        raise ValueError(f"--host {host} can be reached from other machines, where --security {security} "
                         "would serve without TLS: use --security tls (mutual TLS with a private CA made "
                         "here), or --insecure where the network is trusted")
    return security


GATEWAY_ONLY_ENV = ("VLLM_API_KEY", API_KEYS_ENV)
"""Environment variables only the gateway is given (the encoders and LMs start without them)."""


def gateway_key_args(api_keys_file: str = "") -> list[str]:
    """The gateway's flags for ``epd up --api-keys-file`` (none when unset): a path, never a key.
    ``--api-key``'s keys go by the gateway's environment instead (``gateway_key_env``)."""
    return ["--api-keys-file", api_keys_file] if api_keys_file else []


def gateway_key_env(api_keys: list[str] | None) -> dict[str, str]:
    """The gateway's environment for ``epd up --api-key``: the keys in ``API_KEYS_ENV``, one per line
    (none when unset). Never on its command line, which every user of the host can read (``ps``,
    ``/proc/PID/cmdline``); a process's environment only its own user (and root) can."""
    return {API_KEYS_ENV: "\n".join(api_keys)} if api_keys else {}


@dataclass
class Deployment(Elastic):
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    engine_args: str = "{}"
    encoder_args: list[str] = field(default_factory=list)
    lm_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: str = ""
    quiet: bool = False
    with_encoder: bool = True
    """False: colocated (no encoder service; the LM encodes media itself)."""
    n_encoders: int = 1
    """Encoder services (they share the encoder half of the cores)."""
    n_lms: int = 1
    """LM services (they share the LM half of the cores)."""
    n_prefills: int = 0
    """Prefill LMs (``--role prefill``); with ``n_decodes``, requests go E -> P -> D."""
    n_decodes: int = 0
    """Decode LMs (``--role decode``)."""
    security: str = "auto"
    """How the services prove themselves to each other: "token" (a fresh shared token; on a loopback host
    only), "tls" (a private CA, mutual TLS on every link, and the token), "none" (plain gRPC, loopback only)
    or "auto" (token on a loopback host, tls on any other)."""
    epd_facts: bool | None = None
    """The gateway's --epd-facts (the ``epd`` object in answers, instances on /health, the deployment's own
    error details): None turns them on for a loopback host (a development deployment), off otherwise."""
    insecure: bool = False
    """Pass --insecure to every service: "token" or "none" on a non-loopback host, with a warning (the network
    is trusted; the services' own links stay on this host, but other machines can reach their ports)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every service (over this process's own)."""
    api_keys: list[str] = field(default_factory=list, repr=False)
    """The gateway's client API keys (``epd up --api-key``): given to the gateway alone, through its
    environment (``gateway_key_env``), never its command line."""
    drain_grace_s: float = 30.0
    """Every encoder's and LM's ``--drain-grace-s``: how long one told to leave (``remove``, ``stop``) may
    take to finish what it holds; ``remove`` kills what is left after this and a shutdown margin."""

    def __post_init__(self) -> None:
        h = self.host
        self.security = check_security(h, self.security, self.insecure)
        self.port = self.port or free_port(h)
        self.gateway_grpc = f"{h}:{free_port(h)}"
        self.gateway_metrics = free_port()
        """The gateway's internal metrics port (every series, /health with the instances), on loopback."""
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="epd-up-")
        sec = self._security_files()
        self.client_security = SecurityConfig(**sec)
        """What a caller of the encoders' and LMs' APIs presents (readiness checks, tests)."""
        sec_args = self.security_args = [a for k, v in sec.items() for a in ("--" + k.replace("_", "-"), v)]
        """The security flags of this deployment's services (for a service a caller adds beside them)."""
        if self.insecure:
            sec_args.append("--insecure")
        self._elastic_init()
        self.fleet_file = os.path.join(self.log_dir, "fleet.json")
        """The gateway's ``--fleet-file``: every encoder and LM that serves or is starting (rewritten whole)."""
        common = self._common = ["--model", self.model, "--vllm-args", self.engine_args, *sec_args,
                                 "--drain-grace-s", str(self.drain_grace_s)]
        enc_cores, lm_cores = self.enc_cores, self.lm_cores = split_cores()
        n_enc = self.n_encoders if self.with_encoder else 0
        self.encoders = [self._service("encoder", i, n_enc, ["--transfer-host", h, "--cpu-cores", enc_cores,
                                                             *common, *self.encoder_args]) for i in range(n_enc)]
        self.lms = [self._service("lm", i, self.n_lms, ["--cpu-cores", lm_cores, *common, *self.lm_args])
                    for i in range(self.n_lms)]
        # Prefill and decode LMs: each engine's cores set (with a KV connector, vLLM's CPU auto-binding
        # and NIXL's own thread pinning would put both engines' threads on one core), and each its own
        # NIXL side channel on loopback, whatever --host is: every LM is on this host, and the side
        # channel authenticates nobody (--lm-args '--kv-host ... --insecure-kv-side-channel' overrides).
        p_cores, d_cores = pd_cores(enc_cores, lm_cores) if self.n_prefills and self.n_decodes else (lm_cores,) * 2
        for role, n, cores in (("prefill", self.n_prefills, p_cores), ("decode", self.n_decodes, d_cores)):
            self.lms += [self._service(role, i, n, ["--role", role, "--kv-host", KV_HOST,
                                                    "--kv-port", str(free_port(KV_HOST)),
                                                    "--cpu-cores", cores, *common, *self.lm_args], command="lm")
                         for i in range(n)]
        facts = is_loopback(h) if self.epd_facts is None else self.epd_facts
        self.gateway = Service("gateway", ["gateway", "--host", h, "--port", str(self.port),
                                           "--grpc-port", self.gateway_grpc.split(":")[1],
                                           "--metrics-port", str(self.gateway_metrics),
                                           "--encoders", ",".join(e.address for e in self.encoders),
                                           "--lms", ",".join(lm.address for lm in self.lms),
                                           "--fleet-file", self.fleet_file, *sec_args,
                                           *(["--epd-facts"] if facts else []), *self.gateway_args],
                               os.path.join(self.log_dir, "gateway.log"))
        self.services = [*self.encoders, *self.lms, self.gateway]
        self._write_fleet()

    def _security_files(self) -> dict[str, str]:
        """The token (and certificates) in this deployment's log directory, 0600."""
        out: dict[str, str] = {}
        if self.security == "tls":
            out.update(make_certs(os.path.join(self.log_dir, "tls"), ["localhost", "127.0.0.1", "::1", self.host]))
        if self.security != "none":
            out["auth_token_file"] = make_token(os.path.join(self.log_dir, "auth-token"))
        return out

    # The first instance of each role under the names the single-instance callers use.
    @property
    def encoder(self) -> Service | None:
        return self.encoders[0] if self.encoders else None  # colocated: no encoder at all

    @property
    def encoder_addr(self) -> str:
        return self.encoder.address if self.encoder else ""

    @property
    def encoder_metrics(self) -> int:
        return self.encoder.metrics_port if self.encoder else 0

    @property
    def lm(self) -> Service:
        return self.lms[0]

    @property
    def lm_addr(self) -> str:
        return self.lm.address

    @property
    def lm_metrics(self) -> int:
        return self.lm.metrics_port

    def _service(self, role: str, i: int, n: int, args: list[str], command: str = "") -> Service:
        h, port, metrics = self.host, free_port(self.host), free_port(self.host)
        name = role if n == 1 else f"{role}{i}"
        return Service(name, [command or role, "--host", h, "--port", str(port), "--metrics-port", str(metrics),
                              *args],
                       os.path.join(self.log_dir, f"{name}.log"), address=f"{h}:{port}", metrics_port=metrics)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _say(self, msg: str, end: str = "\n") -> None:
        if not self.quiet:
            print(msg, end=end, flush=True)

    def _envs(self) -> tuple[dict[str, str], dict[str, str]]:
        """The gateway's environment and the engines' (without what only the gateway may have)."""
        env = child_env({"PYTHONUNBUFFERED": "1", **self.env, **gateway_key_env(self.api_keys)})
        # VLLM_API_KEY is the gateway's (its clients' key, as for vllm serve). An LM that had it would
        # guard the /v1 routes of its in-process vLLM app against the gateway's own calls.
        return env, {k: v for k, v in env.items() if k not in GATEWAY_ONLY_ENV}

    def start(self, timeout: float = 300.0) -> Deployment:
        env, engine_env = self._envs()
        self._say(f"epd up: model {self.model}; logs in {self.log_dir}")
        t0 = time.monotonic()
        try:
            engines = {}
            for svc in [*self.encoders, *self.lms]:
                svc.start(engine_env)
                engines[svc] = functools.partial(grpc_serving, svc.address, security=self.client_security)
            self._wait(engines, t0, timeout)
            self.gateway.start(env)
            self._wait({self.gateway: self._admitted}, t0, timeout)
        except BaseException:
            self.stop()
            raise
        self._say(f"epd up: ready in {time.monotonic() - t0:.0f}s; OpenAI API at {self.url}/v1 "
                  f"(gRPC {self.gateway_grpc})")
        return self

    def launch(self) -> Deployment:
        """Starts every service at once and returns (``wait_ready`` waits): the gateway answers 503 until
        its engines are ready and admits them as they come (tests/e2e/test_engine_death.py). For a caller
        that does other work while they start."""
        env, engine_env = self._envs()
        self.gateway.start(env)
        for svc in [*self.encoders, *self.lms]:
            svc.start(engine_env)
        self._launched = time.monotonic()
        return self

    def wait_ready(self, timeout: float = 300.0) -> Deployment:
        """After ``launch``: returns once the gateway has admitted every encoder and LM; stops everything
        and raises if one exits or ``timeout`` passes first."""
        t0 = getattr(self, "_launched", time.monotonic())
        try:
            self._wait({svc: functools.partial(grpc_serving, svc.address, security=self.client_security)
                        for svc in [*self.encoders, *self.lms]}, t0, timeout)
            self._wait({self.gateway: self._admitted}, t0, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _admitted(self) -> bool:
        """Ready once the gateway has admitted every encoder and LM started here, not only the first LM."""
        return gateway_admitted(self.url, [e.address for e in self.encoders], [lm.address for lm in self.lms],
                                metrics_url=f"http://127.0.0.1:{self.gateway_metrics}/metrics")

    def _wait(self, checks: dict, t0: float, timeout: float) -> None:
        tty = sys.stdout.isatty()
        cr = "\r" if tty else ""
        try:
            wait_ready(checks, t0 + timeout,
                       on_ready=lambda svc: self._say(f"{cr}  {svc.name} ready ({time.monotonic() - t0:.0f}s)"
                                                      + " " * 20),
                       # a live progress line on terminals; logs and CI get the ready lines only
                       on_wait=(lambda pending: self._say(f"\r  starting {', '.join(s.name for s in pending)} ... "
                                                          f"{time.monotonic() - t0:.0f}s", end="")) if tty else None)
        except TimeoutError as e:
            raise TimeoutError(f"not ready after {timeout:.0f}s (logs in {self.log_dir}): {e}") from None

    def stop(self, grace: float | None = None) -> None:
        """The gateway first (no new requests reach the engines), then every encoder and LM together, in
        parallel (SIGKILL for what is left after ``grace``; default: drain grace + ``SHUTDOWN_MARGIN_S``)."""
        grace = self.drain_grace_s + SHUTDOWN_MARGIN_S if grace is None else grace
        self.gateway.stop(grace)
        engines = [svc for svc in self.services if svc is not self.gateway]
        for svc in engines:
            svc.terminate()
        deadline = time.monotonic() + grace
        for svc in engines:
            svc.finish(deadline)
        cleanup_orphans()

    def __enter__(self) -> Deployment:
        return self if self.gateway.alive() else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def up_lms(prefills: int, decodes: int, lms: int | None) -> int:
    """``epd up``'s LMs of role "both" for its ``--lms``/``--prefills``/``--decodes``; ValueError for a set
    that cannot serve."""
    if bool(prefills) != bool(decodes) or prefills < 0 or decodes < 0:
        raise ValueError("--prefills and --decodes go together (E -> P -> D needs both tiers), each at least 1")
    if lms is None:
        return 0 if prefills else 1
    if lms < 0 or (lms == 0 and not prefills):
        raise ValueError(f"--lms {lms}: at least one LM (or --prefills and --decodes)")
    return lms


def _lm_alone(model: str, engine_args: str) -> bool:
    """Whether ``model`` gets no encoder service (an encoder-decoder model whose encoder this vLLM cannot run
    apart); says so. Raises the services' own start-up error where every one would fail on the model."""
    configure_process_env()  # the check below reads the model's config as the services will
    try:
        engine_cfg = EngineConfig(model=model, vllm_args=engine_args)
        lm_alone = is_encoder_decoder(engine_cfg) and not encoder_apart_verified(engine_cfg)
    except Exception as e:  # noqa: BLE001 - a model vLLM cannot read: the services report it, with its reason
        why = explain(e, model)
        if why is not None:  # one the services would all fail on, for a reason we can name: say it now
            raise why from None
        lm_alone = False
    if lm_alone:
        print(f"epd up: {model} is an encoder-decoder model: no encoder service (the LM encodes the audio "
              "itself; /v1/audio/transcriptions and /v1/audio/translations)", flush=True)
    return lm_alone


def run_up(model: str, host: str, port: int, engine_args: str, security: str = "auto",
           encoder_args: list[str] | None = None, lm_args: list[str] | None = None,
           gateway_args: list[str] | None = None, insecure: bool = False, prefills: int = 0,
           decodes: int = 0, lms: int | None = None, api_keys: list[str] | None = None, encoders: int = 1,
           drain_grace_s: float = 30.0, autoscale=None, autoscale_interval_s: float = 2.0) -> int:
    """``epd up``. Raises ValueError for a configuration refused before anything starts, StartupError
    for a model that no service could start with or a ``port`` in use (before any starts), and
    ``ServiceExited`` or TimeoutError when a service did not start (all of them stopped). An
    encoder-decoder model (Whisper-class) gets an encoder service where this vLLM runs its encoder apart
    by the verified encoder-apart path (``encoder_apart_verified``), else none: its LM then encodes the audio
    itself (docs/design.md, Encoder-decoder models). ``lms``: LMs that prefill and decode (default 1, or 0
    beside prefill and decode LMs; more than 0 beside them is a mixed deployment). ``api_keys``: the
    gateway's client keys (``Deployment.api_keys``: its environment, never its command line). ``autoscale``:
    a ``services.autoscale.policy.Budget`` for the local autoscaler (None: a fixed fleet); ``watch`` waits."""
    check_security(host, security, insecure)  # refused before anything else is read
    lms = up_lms(prefills, decodes, lms)
    if encoders < 1 or drain_grace_s < 0:
        raise ValueError(f"--encoders must be >= 1 and --drain-grace-s >= 0; got {encoders}, {drain_grace_s}")
    check_port("--port", host, port)  # the one port chosen by the caller, not free_port
    check_model(model)
    lm_alone = _lm_alone(model, engine_args)
    dep = Deployment(model=model, host=host, port=port, engine_args=engine_args, security=security,
                     encoder_args=encoder_args or [], lm_args=lm_args or [], gateway_args=gateway_args or [],
                     insecure=insecure, with_encoder=not lm_alone, n_lms=lms, n_encoders=encoders,
                     n_prefills=prefills, n_decodes=decodes, api_keys=api_keys or [], drain_grace_s=drain_grace_s)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    scaler = None
    try:
        dep.start()
        print(json.dumps({"gateway": dep.url + "/v1", "encoder": dep.encoder_addr,
                          **{lm.name: lm.address for lm in dep.lms}}), flush=True)
        if autoscale is not None:
            from services.autoscale.loop import Autoscaler, lm_slots

            slots = lm_slots(engine_args, lm_args, EngineConfig.max_num_seqs)
            scaler = Autoscaler(dep, autoscale, interval_s=autoscale_interval_s, lm_slots=slots).start()
        print("Ctrl-C stops everything.", flush=True)
        return watch(dep, stop)
    finally:
        print("epd up: shutting down", flush=True)
        if scaler is not None:
            scaler.stop()
        dep.stop()

