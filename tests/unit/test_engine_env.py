"""The service environment is set by an explicit call, never by an import, and
early enough that huggingface_hub (imported with vLLM) sees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common.engine import SERVICE_ENV

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> dict:
    """``code`` in a fresh interpreter without the service variables (plus ``env``); its last line is JSON."""
    clean = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_engine_module_leaves_the_environment_unchanged():
    out = _run("import json, os; before = dict(os.environ); import services.common.engine; "
               "print(json.dumps(dict(os.environ) == before))")
    assert out is True


def test_the_command_imports_neither_vllm_nor_huggingface_hub():
    # The service modules load vLLM at their top; the command imports one only after
    # configure_process_env (service_module): an earlier import would fix huggingface_hub's
    # offline flag before the variable is set.
    out = _run("import json, sys; import services.cli, services.gateway.server; services.cli.build_parser(); "
               "print(json.dumps(sorted(m for m in ('vllm', 'huggingface_hub', 'transformers') if m in sys.modules)))")
    assert out == []


def test_the_command_sets_the_environment_before_a_service_module_loads_vllm():
    # The encoder's and the LM's server modules import vLLM at their top, which imports huggingface_hub,
    # which reads its offline flag once, then. The module's import is replaced by that first import of
    # huggingface_hub (loading vLLM's stack in a fresh process takes 15-30 s here and proves no more): what
    # it reads at that moment is what vLLM would.
    out = _run("import importlib, json, sys\n"
               "import services.cli as cli\n"
               "seen = {}\n"
               "def first_import(name):\n"
               "    loaded = 'huggingface_hub' in sys.modules\n"
               "    import huggingface_hub.constants as c\n"
               "    seen[name] = [loaded, c.HF_HUB_OFFLINE]\n"
               "    return c\n"
               "cli.importlib = type(sys)('importlib'); cli.importlib.import_module = first_import\n"
               "cli.service_module('encoder'); cli.service_module('lm')\n"
               "print(json.dumps(seen))")
    assert out == {"services.encoder.server": [False, True], "services.lm.server": [True, True]}


def test_configure_process_env_sets_what_is_unset_and_keeps_the_operators_values():
    out = _run("import json, os; from services.common.engine import configure_process_env; "
               "configure_process_env(); import huggingface_hub.constants as c; "
               "print(json.dumps([os.environ['HF_HUB_OFFLINE'], os.environ['VLLM_WORKER_MULTIPROC_METHOD'], "
               "c.HF_HUB_OFFLINE]))", HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
    assert out == ["0", "spawn", False]
    out = _run("import json; from services.common.engine import configure_process_env; configure_process_env(); "
               "import huggingface_hub.constants as c; print(json.dumps(c.HF_HUB_OFFLINE))")
    assert out is True


def test_a_cpu_engine_with_one_worker_runs_its_model_in_the_enginecore_unless_asked_otherwise():
    from services.common.engine import EngineConfig, one_process_on_cpu

    assert one_process_on_cpu(EngineConfig(), {})
    assert one_process_on_cpu(EngineConfig(executor="uni"), {"tensor_parallel_size": 1})
    assert not one_process_on_cpu(EngineConfig(executor="mp"), {})
    assert not one_process_on_cpu(EngineConfig(), {"tensor_parallel_size": 2})
    assert not one_process_on_cpu(EngineConfig(), {"distributed_executor_backend": "mp"})
    with pytest.raises(ValueError, match="executor"):
        EngineConfig(executor="ray")


def test_vllm_keeps_the_uni_executor_on_cpu_only_under_the_variable_the_service_sets_while_it_starts():
    # vLLM's CPU platform swaps "uni" for "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0
    # (vllm/platforms/cpu.py): build_async_engine sets it around the engine's start and restores it.
    from vllm.engine.arg_utils import AsyncEngineArgs

    from services.cli import default_model
    from services.common.engine import _env

    def backend(multiprocessing: str) -> str:
        with _env({"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}):
            config = AsyncEngineArgs(model=default_model(), distributed_executor_backend="uni").create_engine_config()
        return config.parallel_config.distributed_executor_backend

    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert [backend("1"), backend("0")] == ["mp", "uni"]
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == before
