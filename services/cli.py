"""The ``epd`` command: run one service, bring up a whole deployment, or build
the tiny model.

    epd tiny-model PATH            build the offline tiny Idefics3
    epd encoder [flags]            the encoder service
    epd lm [flags]                 the LM service
    epd gateway [flags]            the gateway (OpenAI REST + gRPC)
    epd up [--model M] [--port N]  one encoder, one LM and the gateway on this machine
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import sys

from services.common.config import add_dataclass_args, from_args

DEFAULT_MODEL_DIR = pathlib.Path(os.environ.get("EPD_CACHE_DIR", pathlib.Path.home() / ".cache" / "epd-serve"))


def default_model(variant: str = "tiny") -> str:
    """The built-in tiny model, built offline on first use."""
    from services.tiny_model import build_tiny_model

    return str(build_tiny_model(DEFAULT_MODEL_DIR / f"{variant}-idefics3", variant=variant))


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _engine_cfg(ns):
    from services.common.engine import EngineConfig

    cfg = from_args(EngineConfig, ns)
    if not cfg.model:
        cfg.model = default_model()
    return cfg


def build_parser() -> argparse.ArgumentParser:
    """The ``epd`` argument parser (one flag per config field); parsing runs nothing."""
    from services.common.engine import EngineConfig
    from services.encoder.config import EncoderServiceConfig
    from services.gateway.config import GatewayConfig
    from services.lm.config import LMServiceConfig

    p = argparse.ArgumentParser(prog="epd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tiny-model", help="build the offline tiny model")
    t.add_argument("path")
    t.add_argument("--variant", default="tiny", choices=["tiny", "tiny-alt", "bench"])
    t.add_argument("--seed", type=int, default=0)

    for name, cls in (("encoder", EncoderServiceConfig), ("lm", LMServiceConfig)):
        sp = sub.add_parser(name, help=f"run the {name} service")
        add_dataclass_args(sp, cls)
        add_dataclass_args(sp.add_argument_group("engine (vLLM)"), EngineConfig)

    g = sub.add_parser("gateway", help="run the gateway")
    add_dataclass_args(g, GatewayConfig)

    u = sub.add_parser("up", help="encoder + LM + gateway on this machine")
    u.add_argument("--model", default="", help="model directory or name (default: the tiny model)")
    u.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--vllm-args", default="{}", help="extra vLLM engine arguments for both engines (JSON)")

    return p


def main(argv: list[str] | None = None) -> int:
    from services.encoder.config import EncoderServiceConfig
    from services.gateway.config import GatewayConfig
    from services.lm.config import LMServiceConfig

    ns = build_parser().parse_args(argv)
    _logging(ns.log_level)
    if ns.cmd == "tiny-model":
        from services.tiny_model import build_tiny_model

        print(build_tiny_model(ns.path, variant=ns.variant, seed=ns.seed))
        return 0
    if ns.cmd == "encoder":
        from services.encoder.server import serve

        asyncio.run(serve(from_args(EncoderServiceConfig, ns), _engine_cfg(ns)))
        return 0
    if ns.cmd == "lm":
        from services.lm.server import serve as serve_lm

        asyncio.run(serve_lm(from_args(LMServiceConfig, ns), _engine_cfg(ns)))
        return 0
    if ns.cmd == "gateway":
        from services.gateway.server import serve as serve_gw

        asyncio.run(serve_gw(from_args(GatewayConfig, ns)))
        return 0
    if ns.cmd == "up":
        from services.up import run_up

        return run_up(model=ns.model or default_model(), host=ns.host, port=ns.port, engine_args=ns.vllm_args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
