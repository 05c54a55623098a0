"""docs/configuration.md documents every flag of the service commands, and only flags that exist
(read from ``services.cli.build_parser``, the parser ``epd`` runs)."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from services.cli import build_parser

pytestmark = pytest.mark.unit

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")
COMMANDS = ("encoder", "lm", "gateway", "up", "health", "certs", "tiny-model")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return {"": root, **{name: sub.choices[name] for name in COMMANDS}}


def _documented() -> set[str]:
    """The flags the tables document: a flag table's first column, and the connector table's last
    ("set from": ``--connector-<key>``)."""
    with open(DOC) as f:
        rows = [line for line in f if line.startswith("| `")]
    cells = [row.split("|")[1] if row.startswith("| `--") else row.rstrip().rstrip("|").split("|")[-1] for row in rows]
    return {flag for cell in cells for flag in re.findall(r"`(--[a-z0-9-]+)`", cell)}


def test_every_documented_flag_exists():
    known = set().union(*(_flags(p) for p in _parsers().values()))
    assert not sorted(_documented() - known), "docs/configuration.md documents flags no command has"


def test_every_service_flag_is_documented():
    documented = _documented()
    documented |= {"--no-" + f[2:] for f in documented}  # booleans: --x documents --no-x
    missing = {name: sorted(_flags(p) - documented) for name, p in _parsers().items()}
    assert not {k: v for k, v in missing.items() if v}, missing
