"""Shared pytest setup: the repository root is importable even when the project
is not installed (``ectransfer``, ``services`` and the generated ``epd`` stubs)."""

import getpass
import os
import shutil
import sys
import tempfile

import pytest

# Illegal item-lifecycle transitions raise in tests (and in the services they start), not just log.
os.environ.setdefault("EPD_STRICT_TRANSITIONS", "1")

# Every vLLM engine the tests start runs its worker inside the engine-core process (vLLM's one-process
# executor, which its CPU platform keeps when V1 multiprocessing is off) instead of a third process:
# one vLLM import less per engine, about 8 s of CPU on a 2-core host and a quarter of the e2e time.
# Tokens do not depend on it. vLLM's default (the worker in its own process, as `vllm serve` and the
# services run it in production) stays covered: the session's shared e2e deployment sets
# MULTIPROCESS_ENGINES, and its teardown checks that its stop leaves no process behind.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MULTIPROCESS_ENGINES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

# Every temporary file of this run, the tests' and the services' they start (`epd up`'s log directories,
# vLLM's ZMQ sockets, which an engine killed mid-test never unlinks, pytest's own tmp_path), under one
# directory: removed when the run passes, kept (and named) when it fails. Runs do not pile up in /tmp.
# Except torch's compile cache: vLLM compiles a few sampler functions with torch.compile (the logprobs' rank
# count, for one), and Inductor keeps what it built under the temporary directory. Under this run's directory
# every engine process would build them again, about 17 s of CPU each on a 2-core host; in torch's own place
# (/tmp/torchinductor_<user>) the first engine builds them and the rest of the run, and later runs, load them.
try:
    _USER = getpass.getuser()
except (KeyError, OSError):
    _USER = f"uid_{os.getuid()}"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_USER}"))
RUN_TMP = tempfile.mkdtemp(prefix="epd-tests-")
os.environ["TMPDIR"] = RUN_TMP
tempfile.tempdir = None  # tempfile reads TMPDIR again

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import ahead, early  # noqa: E402 - needs the root on the path

TIERS = ("unit", "integration", "e2e", "multihost")
"""The order the tiers run in: the e2e tier's shared work starts (tests/early.py) on the core that the
unit and integration tiers leave idle, and is ready when the e2e tier begins."""


def _tier(item) -> int:
    parts = os.path.relpath(str(item.path), os.path.join(ROOT, "tests")).split(os.sep)
    return TIERS.index(parts[0]) if parts[0] in TIERS else len(TIERS)


def _cuda_ipc_available() -> bool:
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """The tiers in ``TIERS``' order (a stable sort: each module's tests stay together, in their order).
    GPU tests carry the ``gpu`` marker and skip cleanly without CUDA and cupy."""
    import pytest

    items.sort(key=_tier)
    if _cuda_ipc_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cupy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The built-in tiny model's directory (built offline on first use)."""
    from services.cli import default_model

    return default_model()


@pytest.fixture(scope="session")
def reference_run(tiny_model):
    """Plain vLLM's answers to every request of ``tests/references.py``: one ``tools.reference``
    subprocess, launched with the session when e2e tests are selected (tests/early.py), else the first time
    a test asks; ``result()`` is the token lists, in the table's order."""
    from tests.references import REFERENCE_REQUESTS
    from tools.reference import launch

    started = early.reference_run()  # at the session's start, beside the unit tier
    if started is not None:
        yield started
        return
    run = launch(tiny_model, list(REFERENCE_REQUESTS.values()))
    yield run
    run.stop()


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[str, list[int]]:
    """``tests/references.py``'s names -> plain vLLM's greedy tokens (waits for the run)."""
    from tests.references import REFERENCE_REQUESTS

    return dict(zip(REFERENCE_REQUESTS, reference_run.result()))


def modules_loaded_twice() -> dict[str, list[str]]:
    """The suite's files that are loaded as more than one module (by two names): each copy has its own
    module-level state, so a second copy of a module that starts servers or runs references starts them
    again, and a second copy of this file made a second run directory (``tests/__init__.py``)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    names: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and os.path.abspath(path).startswith(tests + os.sep):
            names.setdefault(os.path.abspath(path), []).append(name)
    return {path: sorted(n) for path, n in names.items() if len(n) > 1}


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        early.start(session.items)
        ahead.plan(session.items)


_module_running: list[str] = [""]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A module's first test: the next deployment the run needs is launched (tests/ahead.py)."""
    module = getattr(getattr(item, "module", None), "__name__", "")
    if module != _module_running[0]:
        _module_running[0] = module
        ahead.step()


def pytest_sessionfinish(session, exitstatus):
    early.finish()
    ahead.finish()
    twice = modules_loaded_twice()
    if twice:
        session.config.get_terminal_writer().line(f"\ntest files loaded under two module names: {twice}", red=True)
        session.exitstatus = exitstatus = pytest.ExitCode.TESTS_FAILED
    if exitstatus == 0:
        shutil.rmtree(RUN_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus != 0 and os.path.isdir(RUN_TMP):
        terminalreporter.write_line(f"temporary files of this run (service logs) kept in {RUN_TMP}")
