"""Builds argparse CLIs from config dataclasses (one flag per field, help from
the field's docstring) and back. A list field is one comma-separated value, unless its
``field(metadata={"nargs": "+"})`` asks for space-separated values (a flag that mirrors one of
``vllm serve``'s, whose values may hold commas)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from typing import Any, get_type_hints


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    hints = get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        flag = "--" + (prefix + f.name).replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        typ = hints[f.name]
        help_ = f"{docs.get(f.name, '')} (default: {default!r})"
        dest = prefix + f.name
        if typ is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif typ in (int, float, str):
            parser.add_argument(flag, dest=dest, type=typ, default=default, help=help_)
        elif getattr(typ, "__origin__", None) is list and f.metadata.get("nargs"):
            parser.add_argument(flag, dest=dest, nargs=f.metadata["nargs"], default=default, help=help_)
        elif getattr(typ, "__origin__", None) is list:
            parser.add_argument(flag, dest=dest, default=default, help=help_ + " (comma-separated)",
                                type=lambda s: [x for x in s.split(",") if x])
        else:  # dicts and anything else: JSON
            parser.add_argument(flag, dest=dest, type=json.loads, default=default, help=help_ + " (JSON)")


def from_args(cls, ns: argparse.Namespace, prefix: str = "") -> Any:
    kw = {f.name: getattr(ns, prefix + f.name) for f in dataclasses.fields(cls) if f.init}
    return cls(**kw)


def to_args(obj, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags ``add_dataclass_args`` reads back as ``obj`` (``from_args``): one per field whose value is
    not its default, fields named in ``skip`` left out (what must not show on a command line)."""
    args: list[str] = []
    for f in dataclasses.fields(obj):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        value = getattr(obj, f.name)
        if not f.init or f.name in skip or value == default:
            continue
        flag = "--" + (prefix + f.name).replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list) and f.metadata.get("nargs"):
            args += [flag, *map(str, value)]
        elif isinstance(value, list):
            args.append(f"{flag}={','.join(map(str, value))}")
        else:  # flag=value: a value that starts with "-" is not taken for a flag
            args.append(f"{flag}={value if isinstance(value, (int, float, str)) else json.dumps(value)}")
    return args


def transport_list(value: str) -> list[str]:
    """A ``--transports`` value (comma-separated names) as the connector's list."""
    return [t.strip() for t in value.split(",") if t.strip()]
