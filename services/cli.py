"""The ``epd`` command: run one service, bring up a whole deployment, or build
the tiny model.

    epd tiny-model PATH [--family F]  build an offline tiny model (Idefics3 by default)
    epd encoder [flags]            the encoder service
    epd lm [flags]                 the LM service
    epd gateway [flags]            the gateway (OpenAI REST + gRPC)
    epd up [--model M] [--port N]  one encoder, one LM and the gateway on this machine
    epd certs DIR                  a private CA and a certificate for the services (TLS)
    epd health ADDRESS             exit 0 if the service reports SERVING (exec probes)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import shlex
import sys
from collections.abc import Mapping

from ectransfer.connector.config import ConnectorTuning
from peerauth import SecurityConfig
from services.autoscale.policy import Budget
from services.certs import make_certs
from services.child import ServiceExited
from services.common.config import add_dataclass_args, from_args
from services.common.engine import EngineConfig, EngineDied, UnsupportedModel, configure_process_env
from services.encoder.config import EncoderServiceConfig
from services.gateway.config import API_KEYS_ENV, GatewayConfig
from services.gateway.tenants import Tenants
from services.gateway.workers import WorkerSeat
from services.lm.config import LMServiceConfig
from services.startup_errors import ERROR_PREFIX, StartupError, check_model, check_port, explain

DEFAULT_MODEL_DIR = pathlib.Path(os.environ.get("EPD_CACHE_DIR", pathlib.Path.home() / ".cache" / "epd-serve"))


CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
"""The source checkout this ``services`` package runs from (an editable install, or ``python -m`` from
its root); an installed wheel has none around it."""


def use_checkout_tools() -> None:
    """Makes the checkout's ``tools`` package importable, for the commands that are tooling themselves
    (``epd tiny-model``, the built-in tiny model, ``make demo``), which import it inside their functions,
    never at a module's top. ``tools/`` is not an installed package (docs/architecture.md, "Installed
    packages"): from the checkout's root (``python -m``, pytest) it is on ``sys.path`` already; ``epd``
    of an editable install finds it beside this package. Raises ValueError where there is no checkout
    (an installed wheel)."""
    tools = CHECKOUT / "tools"
    if not (tools / "tiny_model.py").is_file():  # site-packages of a wheel: no checkout, maybe another `tools`
        raise ValueError("tiny models are built by the source checkout's tools/, which an installed epd-serve "
                         "does not have: pass --model (a model directory or name), or run from a checkout")
    spec = importlib.util.find_spec("tools")
    if spec is None or not spec.origin or pathlib.Path(spec.origin).resolve() != tools / "__init__.py":
        # First, so that no other distribution's top-level `tools` is taken for the checkout's.
        sys.path.insert(0, str(CHECKOUT))


def default_model(variant: str = "tiny", family: str = "idefics3") -> str:
    """The built-in tiny model of ``family`` (Idefics3 unless asked), built offline on first use (by the
    checkout's ``tools.tiny_model``; ValueError without a checkout: ``use_checkout_tools``)."""
    use_checkout_tools()
    from tools.tiny_model import build_tiny_model

    return str(build_tiny_model(DEFAULT_MODEL_DIR / f"{variant}-{family}", variant=variant, family=family))


def tiny_model(ns: argparse.Namespace) -> int:
    """``epd tiny-model``: builds the model and prints its folder. An unknown family, or a variant the
    family does not have, is refused before anything is written (exit 2)."""
    try:
        use_checkout_tools()
        from tools.tiny_model import build_tiny_model

        print(build_tiny_model(ns.path, variant=ns.variant, seed=ns.seed, family=ns.family))
    except ValueError as e:
        print(f"epd: error: {e}", file=sys.stderr)
        return 2
    return 0


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _engine_cfg(ns):
    cfg = from_args(EngineConfig, ns)
    if not cfg.model:
        cfg.model = default_model()
    return cfg


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), but a bad flag or value is said in two lines: what
    is wrong and where the flags are listed, not after a usage block that names every flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n  `{self.prog} --help` lists the flags and their values\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``epd`` argument parser (one flag per config field); parsing runs nothing."""
    p = Parser(prog="epd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tiny-model", help="build an offline tiny model (docs/models.md)")
    t.add_argument("path")
    # Not choices=: the families are tools/'s (the checkout's), which only this command may import.
    t.add_argument("--family", default="idefics3", metavar="FAMILY",
                   help="idefics3 (default) or another tiny family (docs/models.md)")
    t.add_argument("--variant", default="tiny", choices=["tiny", "tiny-alt", "bench", "bench-light"],
                   help="Idefics3 size; the other families have only 'tiny'")
    t.add_argument("--seed", type=int, default=0)

    for name, cls in (("encoder", EncoderServiceConfig), ("lm", LMServiceConfig)):
        sp = sub.add_parser(name, help=f"run the {name} service")
        add_dataclass_args(sp, cls)
        add_dataclass_args(sp.add_argument_group("engine (vLLM)"), EngineConfig)
        add_dataclass_args(sp.add_argument_group("security (every internal gRPC link)"), SecurityConfig)
        add_dataclass_args(sp.add_argument_group("connector (encoder-to-LM transfer tuning)"), ConnectorTuning,
                           prefix="connector_")

    g = sub.add_parser("gateway", help="run the gateway")
    add_dataclass_args(g, GatewayConfig)
    add_dataclass_args(g.add_argument_group("security (the gateway's calls to encoders and LMs)"), SecurityConfig)
    g.add_argument("--worker-of", default="", help=argparse.SUPPRESS)  # set by --workers' supervisor only

    h = sub.add_parser("health", help="exit 0 when the service at ADDRESS reports SERVING (a Kubernetes exec "
                                      "probe for services that speak TLS, which grpc probes cannot)")
    h.add_argument("address", help="host:port")
    h.add_argument("--service", default="", help="grpc.health.v1 service name (default: the whole process)")
    h.add_argument("--timeout", type=float, default=2.0)
    add_dataclass_args(h.add_argument_group("security"), SecurityConfig)

    c = sub.add_parser("certs", help="make a private CA and one certificate for every service (for tests and "
                                     "first deployments; use your own PKI in production)")
    c.add_argument("dir")
    c.add_argument("--hosts", default="localhost,127.0.0.1",
                   help="names and addresses the certificate is valid for (comma-separated)")

    u = sub.add_parser("up", help="encoder + LM + gateway on this machine")
    u.add_argument("--model", default="", help="model directory or name (default: the tiny model)")
    u.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--vllm-args", default="{}", help="extra vLLM engine arguments for both engines (JSON)")
    for role in ("encoder", "lm", "gateway"):
        u.add_argument(f"--{role}-args", default="", help=f"more flags for the {role} service, one string "
                       f"(e.g. --lm-args '--enable-auto-tool-choice --tool-call-parser hermes')")
    u.add_argument("--prefills", type=int, default=0, help="prefill LMs (E -> P -> D, with --decodes; "
                   "KV moves over NIXL); default: one LM that prefills and decodes")
    u.add_argument("--decodes", type=int, default=0, help="decode LMs (with --prefills)")
    u.add_argument("--lms", type=int, default=None, help="LMs that prefill and decode (default: 1, or 0 with "
                   "--prefills/--decodes; more beside them is a mixed deployment: the gateway sends a request to "
                   "a pair, or to such an LM when it is less busy than every decode LM)")
    u.add_argument("--security", default="auto", choices=["auto", "token", "tls", "none"],
                   help="how the services prove themselves to each other: a fresh shared token (loopback --host "
                        "only), mutual TLS with a private CA plus the token, nothing (loopback only), or auto "
                        "(default: token on a loopback --host, tls on any other)")
    u.add_argument("--api-key", nargs="+", default=None,
                   help="client API keys for the gateway, as vllm serve's --api-key; the gateway gets them in its "
                        "environment, never its command line. Prefer VLLM_API_KEY (which only the gateway is "
                        "given) or --api-keys-file: this command's own line is visible in ps")
    u.add_argument("--workers", type=int, default=1, help="gateway processes serving its ports (its --workers)")
    u.add_argument("--api-keys-file", default="", help="the gateway's --api-keys-file (tenants and their keys)")
    u.add_argument("--insecure", action="store_true",
                   help="pass --insecure to every service: --security token or none on a non-loopback --host, "
                        "with a warning (only where the network is trusted)")
    u.add_argument("--encoders", type=int, default=1, help="encoder services at start (they share the encoder "
                   "half of the cores); with --autoscale, the autoscaler adds and removes them")
    _add_elastic_args(u)
    return p


def _add_elastic_args(u: argparse.ArgumentParser) -> None:
    """``epd up``'s flags for instances that leave and the local autoscaler."""
    u.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="every encoder's and LM's --drain-grace-s: how long one that leaves (removed, or an "
                        "autoscaler's scale-down) may take to finish what it holds")
    u.add_argument("--autoscale", action="store_true",
                   help="run the local autoscaler: add and remove encoders and LMs from their scaling signals, "
                        "within the --autoscale-* budget (docs/design.md, \"Elastic fleet\")")
    u.add_argument("--autoscale-interval-s", type=float, default=2.0,
                   help="seconds between the autoscaler's scrapes of the instances' metrics ports")
    add_dataclass_args(u.add_argument_group("autoscale (with --autoscale)"), Budget, prefix="autoscale_")


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the process exit status. A service whose vLLM
    engine died exits 1 (its supervisor restarts it)."""

    try:
        return _main(argv)
    except EngineDied as e:
        logging.getLogger("services.cli").error("exiting: %s", e)
        return 1


def service_module(cmd: str):
    """The ``server`` module of service ``cmd`` ("encoder", "lm" or "gateway"), imported by its own process
    only: the encoder's and the LM's load vLLM and torch at their top, after ``configure_process_env``
    (huggingface_hub reads its offline flag once, when vLLM first imports it); a gateway loads neither."""
    if cmd == "gateway":
        return importlib.import_module("services.gateway.server")
    configure_process_env()
    return importlib.import_module(f"services.{cmd}.server")


def load_tenants(cfg: GatewayConfig, environ: Mapping[str, str] = os.environ) -> Tenants:
    """The gateway's API keys, loaded before it starts: ``--api-key``'s, else ``API_KEYS_ENV``'s (one
    per line: how ``epd up`` hands them over, off the command line), else ``VLLM_API_KEY``'s
    (``Tenants.from_config``); and ``--api-keys-file``'s. A keys file that does not load is a refused
    configuration (ValueError), named with its reason (never a key)."""
    from_env = [k.strip() for k in environ.get(API_KEYS_ENV, "").splitlines() if k.strip()]
    if from_env and not cfg.api_key:
        cfg = dataclasses.replace(cfg, api_key=from_env)
    try:
        return Tenants.from_config(cfg, environ)
    except OSError as e:
        raise ValueError(f"--api-keys-file: {e}") from None


SERVICE_CONFIGS = {"encoder": EncoderServiceConfig, "lm": LMServiceConfig, "gateway": GatewayConfig}


def listen_ports(cmd: str, cfg) -> list[tuple[str, str, int]]:
    """The (flag, host, port) service ``cmd`` will listen on that ``check_port`` can test before it
    starts: its API ports, an encoder's Transfer port and a prefill/decode LM's NIXL side channel.
    The metrics port is left to the bind itself (``explain`` reads its failure)."""
    ports = [("--port", cfg.host, cfg.port)]
    if cmd == "gateway":
        ports.append(("--grpc-port", cfg.host, cfg.grpc_port))
    elif cmd == "encoder":
        ports.append(("--transfer-port", cfg.transfer_host, cfg.transfer_port))
    elif cfg.role != "both":
        ports.append(("--kv-port", cfg.kv_host, cfg.kv_port))
    return ports


def say_error(e: BaseException) -> None:
    """Why this command cannot start: its last lines on stderr, from ``ERROR_PREFIX`` (what
    ``services.child.summary_from_log`` finds in a service's log)."""
    print(f"{ERROR_PREFIX}{e}", file=sys.stderr, flush=True)


def run_service(ns: argparse.Namespace) -> int:
    """``epd encoder``, ``epd lm`` or ``epd gateway``: 0 once it stopped; 2 for a configuration it
    refused or a start-up failure ``explain`` knows (the reason printed last, the traceback logged
    before it); any other exception goes on, traceback and all (``EngineDied``: exit 1 in ``main``)."""
    model = ""
    try:  # configurations are refused here, before anything starts (exit 2)
        security = from_args(SecurityConfig, ns)
        cfg = from_args(SERVICE_CONFIGS[ns.cmd], ns)
        seat = WorkerSeat.from_flag(ns.worker_of) if ns.cmd == "gateway" and ns.worker_of else None
        for flag, host, port in listen_ports(ns.cmd, cfg) if seat is None else ():  # a worker's: shared
            check_port(flag, host, port)  # before minutes of engine start-up, not after
        if ns.cmd == "gateway":
            server = service_module(ns.cmd)
            server.check(cfg, security)  # the internal metrics port's exposure, and the state secret's file
            run = server.serve(cfg, security=security, tenants=load_tenants(cfg), worker=seat)
        else:
            configure_process_env()  # before the tiny model's build may import huggingface_hub
            engine_cfg = _engine_cfg(ns)
            model = engine_cfg.model
            check_model(model)  # before vLLM is imported
            server = service_module(ns.cmd)
            server.check(cfg, security)
            run = server.serve(cfg, engine_cfg, security=security,
                               tuning=from_args(ConnectorTuning, ns, prefix="connector_"))
    except (ValueError, StartupError) as e:
        say_error(e)
        return 2
    try:
        asyncio.run(run)
    except (UnsupportedModel, StartupError) as e:  # read from the model's config, before any engine started
        say_error(e)
        return 2
    except EngineDied:
        raise
    except Exception as e:
        why = explain(e, model)
        if why is None:
            raise
        logging.getLogger("services.cli").error("%s could not start", ns.cmd, exc_info=e)  # the service's log
        say_error(why)
        return 2
    return 0


def _main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _logging(ns.log_level)
    if ns.cmd == "tiny-model":
        return tiny_model(ns)
    if ns.cmd in ("encoder", "lm", "gateway"):
        return run_service(ns)
    if ns.cmd == "health":
        from services.probe import grpc_serving  # grpc only: it runs beside a gateway (no torch, no vLLM)

        return 0 if grpc_serving(ns.address, ns.timeout, from_args(SecurityConfig, ns), ns.service) else 1
    if ns.cmd == "certs":
        print(json.dumps(make_certs(ns.dir, [h for h in ns.hosts.split(",") if h]), indent=2))
        return 0
    if ns.cmd == "up":
        # services.up reaches torch (ectransfer.shm's orphan cleanup): only `epd up` loads it.
        from services.up import gateway_key_args, run_up

        try:
            budget = from_args(Budget, ns, prefix="autoscale_") if ns.autoscale else None
            return run_up(model=ns.model or default_model(), host=ns.host, port=ns.port, engine_args=ns.vllm_args,
                          security=ns.security, encoder_args=shlex.split(ns.encoder_args),
                          lm_args=shlex.split(ns.lm_args),
                          gateway_args=[*gateway_key_args(ns.api_keys_file),
                                        *([f"--workers={ns.workers}"] if ns.workers != 1 else []),
                                        *(budget.gateway_args() if budget else []), *shlex.split(ns.gateway_args)],
                          insecure=ns.insecure, prefills=ns.prefills, decodes=ns.decodes, lms=ns.lms,
                          api_keys=ns.api_key, encoders=ns.encoders, drain_grace_s=ns.drain_grace_s,
                          autoscale=budget, autoscale_interval_s=ns.autoscale_interval_s)
        except (ValueError, StartupError) as e:  # refused before anything started
            say_error(e)
            return 2
        except (ServiceExited, TimeoutError) as e:  # a service did not start: everything is stopped
            say_error(e)
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
