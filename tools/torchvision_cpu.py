"""Install a torchvision that imports beside CPU torch (``make install``, CPU extra).

Why this exists: vLLM's Qwen2.5-VL, Gemma 3 and LLaVA model files import
transformers' image/video processors, which need ``torchvision``'s pure-tensor
transforms.  The package indexes this project installs from carry torchvision
only as a CUDA build.  Its compiled ops (``_C.so``) cannot load beside
``torch==X+cpu``; torchvision then runs without them (``extension._has_ops()``
is False) except for two ``torch.library.register_fake("torchvision::nms"/"qnms")``
decorators in ``torchvision/_meta_registrations.py`` that, unlike every other
registration in that file, are not guarded by ``_has_ops()`` and make
``import torchvision`` (and so ``import vllm``) fail.  This script installs the
torchvision release that matches the installed torch (``0.(minor + 15)``)
without dependencies and guards those two registrations.  Nothing compiled is
used: detection ops (``nms``, ``roi_align``) stay unavailable, the transforms
the processors use work.

Idempotent: does nothing when an importable torchvision of the matching release
is installed.  The wheel is unpacked into a staging folder inside the
environment, patched there, and only then moved into ``site-packages``, so a
process that imports vLLM meanwhile never sees the unpatched module.

Usage: ``python tools/torchvision_cpu.py`` (with the environment's python).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

PATCH_MARKER = "# epd-serve: guarded for CPU torch"
_FAKE = "@torch.library.register_fake("
_GUARD = f'''
{PATCH_MARKER} (tools/torchvision_cpu.py): the compiled ops of this build are not loaded.
def _register_fake_if_ops(op_name):
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(op_name)(fn)
        return fn

    return wrapper

'''


def matching_version(torch_version: str) -> str:
    """The torchvision release built against ``torch_version`` (2.13.0+cpu -> 0.28.0, 2.9.1 -> 0.24.1)."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version)
    if not m or m.group(1) != "2":
        raise ValueError(f"no known torchvision release for torch {torch_version!r}")
    return f"0.{int(m.group(2)) + 15}.{m.group(3)}"


def patch_source(text: str) -> str:
    """Return ``_meta_registrations.py`` with every ``register_fake`` guarded by ``_has_ops()``."""
    if PATCH_MARKER in text:
        return text
    first = text.find(_FAKE)
    if first < 0:
        return text
    guarded = text[first:].replace(_FAKE, "@_register_fake_if_ops(")
    return text[:first] + _GUARD.lstrip("\n") + "\n" + guarded


def _installed_version(site: pathlib.Path) -> str | None:
    for d in site.glob("torchvision-*.dist-info"):
        return d.name[len("torchvision-"):-len(".dist-info")]
    return None


def _import_ok() -> bool:
    """``import torchvision`` in a fresh interpreter (this one may have cached a failure)."""
    probe = "import torchvision, torchvision.transforms.v2.functional"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, env=dict(os.environ)).returncode == 0


def stage_install(site: pathlib.Path, dist: str, spec: str, prepare) -> None:
    """Install ``spec`` without dependencies into a staging folder beside ``site``, let ``prepare(stage)``
    patch it there, then replace ``dist``'s package, its ``.libs`` and dist-info in ``site`` with it, so that
    a process importing vLLM meanwhile never sees the unpatched package. Shared with torchaudio_cpu."""
    stage = pathlib.Path(tempfile.mkdtemp(prefix=f".{dist}-stage-", dir=site.parent))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(stage), spec],
            check=True, env=dict(os.environ),  # explicit: services/common/spawn.py
        )
        prepare(stage)
        for old in [*site.glob(f"{dist}-*.dist-info"), site / dist, site / f"{dist}.libs"]:
            shutil.rmtree(old, ignore_errors=True)
        for entry in sorted(stage.iterdir()):
            os.replace(entry, site / entry.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def install(site: pathlib.Path | None = None) -> str:
    """Install and patch; return a one-line summary of what was done."""
    import torch

    site = site or pathlib.Path(sysconfig.get_paths()["purelib"])
    want = matching_version(torch.__version__)
    have = _installed_version(site)
    if have and have.split("+")[0] == want:
        meta = site / "torchvision" / "_meta_registrations.py"
        if meta.exists():
            text = meta.read_text(encoding="utf-8")
            if PATCH_MARKER not in text:
                meta.write_text(patch_source(text), encoding="utf-8")
        if _import_ok():
            return f"torchvision {have} already installed and importable"

    def guard(stage: pathlib.Path) -> None:
        meta = stage / "torchvision" / "_meta_registrations.py"
        meta.write_text(patch_source(meta.read_text(encoding="utf-8")), encoding="utf-8")

    stage_install(site, "torchvision", f"torchvision=={want}", guard)
    if not _import_ok():
        raise RuntimeError(f"torchvision {want} installed in {site} but `import torchvision` fails")
    return f"torchvision {want} installed (CPU-safe) in {site}"


if __name__ == "__main__":
    print(install())
