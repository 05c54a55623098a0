"""Generates the gRPC stubs from ``protos/`` into the git-ignored ``epd`` package.

Run at install time (``make install`` and the Docker build call it). The proto
path is ``protos/`` so the generated modules import each other as
``epd.transfer.v1.transfer_pb2`` without any rewriting.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT  # stubs land in ROOT/epd/..., next to the protos' package layout
STAMP = ROOT / "epd" / ".protos.sha256"


def _digest(protos: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in protos:
        h.update(p.relative_to(PROTO_DIR).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def generate(force: bool = False) -> bool:
    """Builds the stubs unless they are up to date. Returns True if it built."""
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    digest = _digest(protos)
    if not force and STAMP.exists() and STAMP.read_text() == digest:
        return False
    from grpc_tools import protoc  # build-time dependency only

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *[str(p) for p in protos],
    ]
    # Stubs of protos that no longer exist (a package moved) must not stay importable.
    for old in [*(OUT_DIR / "epd").rglob("*_pb2*.py"), *(OUT_DIR / "epd").rglob("*_pb2*.pyi")]:
        old.unlink()
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    # Regular packages (not namespace packages) so setuptools and mypy find them.
    for d in {p.parent for p in (OUT_DIR / "epd").rglob("*_pb2.py")}:
        while d != OUT_DIR:
            (d / "__init__.py").touch()
            d = d.parent
    STAMP.write_text(digest)
    return True


if __name__ == "__main__":
    built = generate(force="--force" in sys.argv)
    print("protos: generated" if built else "protos: up to date")
