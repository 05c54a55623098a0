"""Offline builder for tiny random-weight checkpoints of the families in ``tools/tiny_families/``
(Idefics3 by default): ``build_tiny_model`` stages a family's build, marks it and moves it into place.

Why this exists: the tests and the demo need models with a *real* multimodal architecture (for
Idefics3: SigLIP-style vision tower -> pixel-shuffle connector -> Llama decoder) that vLLM serves and
that transformers' ``AutoProcessor`` / ``AutoTokenizer`` / ``AutoConfig`` load, without downloading
anything.  Output is byte-identical for the same family, ``variant`` and ``seed``.

Usage: ``python -m tools.tiny_model PATH [--family idefics3] [--variant tiny] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile

from tools.tiny_families import FAMILIES, build_family, check, variants
from tools.tiny_families.common import dump_json

MARKER_NAME = "epd_tiny_model.json"
FORMAT_VERSION = 1


def _marker(variant: str, seed: int, family: str = "idefics3") -> dict:
    if family == "idefics3":  # the marker of builds made before other families existed
        return {"format_version": FORMAT_VERSION, "seed": seed, "variant": variant}
    return {"family": family, "format_version": FORMAT_VERSION, "seed": seed, "variant": variant}


def read_meta(path: str | os.PathLike) -> dict | None:
    """Return the marker dict of a built directory, or None."""
    try:
        return json.loads((pathlib.Path(path) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_tiny_model(path: str | os.PathLike, *, variant: str = "tiny", seed: int = 0,
                     family: str = "idefics3") -> pathlib.Path:
    """Write a tiny model directory of ``family`` at ``path`` and return it.

    ``variant`` picks an Idefics3 size (``tools.tiny_families.idefics3.VARIANTS``); the
    other families (:data:`tools.tiny_families.FAMILIES`) have one size, ``tiny``.

    Idempotent: returns immediately when ``path`` already holds a build of the
    same ``variant``/``seed`` (see :data:`MARKER_NAME`).  Files are built in a
    sibling temp dir and moved in one by one, marker last, so an interrupted
    build is never mistaken for a finished one and concurrent builders of the
    same variant are harmless.
    """
    check(family, variant)
    marker = _marker(variant, seed, family)
    out = pathlib.Path(path).resolve()
    if read_meta(out) == marker:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_NAME).unlink(missing_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tiny_model_", dir=out.parent))
    try:
        build_family(family, tmp, seed, variant)
        for f in sorted(tmp.iterdir()):
            os.chmod(f, 0o644)
            os.replace(f, out / f.name)
        dump_json(marker, tmp / MARKER_NAME)
        os.replace(tmp / MARKER_NAME, out / MARKER_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="output directory")
    parser.add_argument("--family", choices=FAMILIES, default="idefics3")
    parser.add_argument("--variant", choices=sorted(variants("idefics3")), default="tiny",
                        help="Idefics3 size; the other families have only 'tiny'")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.path, variant=args.variant, seed=args.seed, family=args.family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
