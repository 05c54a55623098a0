"""Shared pytest setup: the repository root is importable even when the project
is not installed (``ectransfer``, ``services`` and the generated ``epd`` stubs)."""

import os
import sys

import pytest

# Illegal item-lifecycle transitions raise in tests (and in the services they start), not just log.
os.environ.setdefault("EPD_STRICT_TRANSITIONS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _cuda_ipc_available() -> bool:
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """GPU tests carry the ``gpu`` marker and skip cleanly without CUDA and cupy."""
    import pytest

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
