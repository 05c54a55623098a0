"""What stops vLLM's ECCPUConnector on this host: builds the engine config as `vllm serve` would, then the
connector's scheduler half, and prints the first error (docs/benchmarks.md, issue 34).

    python bench/probe_ec_cpu.py 1   # with vLLM's V2 model runner, which the connector needs
    python bench/probe_ec_cpu.py 0   # without it
"""

import os
import sys


def main() -> int:
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = sys.argv[1] if len(sys.argv) > 1 else "1"
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.cpu.connector import ECCPUConnector
    from vllm.engine.arg_utils import EngineArgs

    model = os.path.expanduser("~/.cache/epd-serve/tiny-idefics3")
    try:
        args = EngineArgs(model=model, enforce_eager=True, max_model_len=1024,
                          ec_transfer_config=ECTransferConfig(ec_connector="ECCPUConnector", ec_role="ec_producer"))
        cfg = args.create_engine_config()
        print("config ok; use_v2_model_runner =", cfg.use_v2_model_runner)
        ECCPUConnector(cfg, ECConnectorRole.SCHEDULER)
    except Exception as e:  # noqa: BLE001 - the probe's answer is the error
        print("ERROR:", type(e).__name__, " | ".join(str(e).splitlines()[:4]))
        return 1
    print("connector ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
