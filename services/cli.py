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
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import shlex
import sys

from ectransfer.connector.config import ConnectorTuning
from peerauth import SecurityConfig
from services.certs import make_certs
from services.common.config import add_dataclass_args, from_args
from services.common.engine import EngineConfig, EngineDied, UnsupportedModel, configure_process_env
from services.encoder.config import EncoderServiceConfig
from services.gateway.config import GatewayConfig
from services.gateway.tenants import Tenants
from services.lm.config import LMServiceConfig

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


def build_parser() -> argparse.ArgumentParser:
    """The ``epd`` argument parser (one flag per config field); parsing runs nothing."""
    p = argparse.ArgumentParser(prog="epd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="client API keys for the gateway, as vllm serve's --api-key (also read from VLLM_API_KEY, "
                        "which only the gateway is given)")
    u.add_argument("--api-keys-file", default="", help="the gateway's --api-keys-file (tenants and their keys)")
    u.add_argument("--insecure", action="store_true",
                   help="pass --insecure to every service: --security token or none on a non-loopback --host, "
                        "with a warning (only where the network is trusted)")

    return p


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


def load_tenants(cfg: GatewayConfig) -> Tenants:
    """The gateway's API keys, loaded before it starts: a keys file that does not load is a refused
    configuration (ValueError), named with its reason (never a key)."""
    try:
        return Tenants.from_config(cfg)
    except OSError as e:
        raise ValueError(f"--api-keys-file: {e}") from None


def _main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _logging(ns.log_level)
    if ns.cmd == "tiny-model":
        return tiny_model(ns)
    if ns.cmd in ("encoder", "lm", "gateway"):
        try:  # configurations are refused here, before anything starts (exit 2)
            security = from_args(SecurityConfig, ns)
            server = service_module(ns.cmd)
            if ns.cmd == "gateway":
                cfg = from_args(GatewayConfig, ns)
                run = server.serve(cfg, security=security, tenants=load_tenants(cfg))
            else:
                cfg = from_args(EncoderServiceConfig if ns.cmd == "encoder" else LMServiceConfig, ns)
                server.check(cfg, security)
                run = server.serve(cfg, _engine_cfg(ns), security=security,
                                   tuning=from_args(ConnectorTuning, ns, prefix="connector_"))
        except ValueError as e:
            print(f"epd: error: {e}", file=sys.stderr)
            return 2

        try:
            asyncio.run(run)
        except UnsupportedModel as e:  # read from the model's config, before any engine started
            print(f"epd: error: {e}", file=sys.stderr)
            return 2
        return 0
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
            return run_up(model=ns.model or default_model(), host=ns.host, port=ns.port, engine_args=ns.vllm_args,
                          security=ns.security, encoder_args=shlex.split(ns.encoder_args),
                          lm_args=shlex.split(ns.lm_args),
                          gateway_args=[*gateway_key_args(ns.api_key, ns.api_keys_file), *shlex.split(ns.gateway_args)],
                          insecure=ns.insecure, prefills=ns.prefills, decodes=ns.decodes, lms=ns.lms)
        except ValueError as e:  # refused before anything started
            print(f"epd: error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
