"""The tree's floors, checked: the transfer library owns its protocol and imports no service, and the
item descriptor is one message the encoder emits and the LM consumes (no field-by-field copy)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from epd.encoder.v1 import encoder_pb2
from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_ectransfer_imports_no_service_and_no_service_protocol():
    offenders = {}
    for path in sorted((ROOT / "ectransfer").rglob("*.py")):
        bad = {m for m in imported_modules(path)
               if m.split(".")[0] in ("services", "tools") or m.startswith(("epd.encoder", "epd.lm", "epd.gateway"))}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"ectransfer must stand alone (its protocol is epd.transfer.v1): {offenders}"


def test_item_descriptor_is_one_message_from_encoder_to_lm():
    meta = encoder_pb2.ItemMetadata.DESCRIPTOR
    assert {f.name for f in meta.fields} == {"identifier", "index", "modality", "source"}
    assert meta.fields_by_name["source"].message_type is transfer_pb2.ItemSource.DESCRIPTOR
    assert lm_pb2.MMItem.DESCRIPTOR.fields_by_name["source"].message_type is transfer_pb2.ItemSource.DESCRIPTOR


def test_gateway_forwards_the_descriptor_without_copying_its_fields():
    """The gateway may read the fields it decides on (the endpoint, for failover; whether a layout came,
    for whether media bytes must travel; the readers' claims, to give an E -> P -> D request's decode LM
    its own) and never builds an ItemSource itself."""
    fields = set(transfer_pb2.ItemSource.DESCRIPTOR.fields_by_name) - {
        "transfer_endpoint", "placeholder_token_ids", "claim", "extra_claims"}
    for path in sorted((ROOT / "services" / "gateway").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "ItemSource" not in names, f"{path.name} builds an ItemSource"
        assert not names & fields, f"{path.name} reads {sorted(names & fields)} of an item descriptor"


def test_lm_message_wire_layout_is_unchanged_by_the_move():
    """MMItem.source kept the LM's former ItemSource numbering: a gateway of either side of the move
    writes the same bytes."""
    numbers = {f.name: f.number for f in transfer_pb2.ItemSource.DESCRIPTOR.fields}
    assert numbers == {"transfer_endpoint": 1, "encoder_id": 2, "num_embeds": 3, "embed_width": 4, "dtype": 5,
                       "placeholder_token_ids": 6, "prompt_token_ids": 7, "is_embed": 8, "claim": 9, "mm_kwargs": 10,
                       "extra_claims": 11}


def test_peerauth_is_the_floor_below_the_library_and_the_services():
    bad = {m for path in (ROOT / "peerauth").rglob("*.py") for m in imported_modules(path)
           if m.split(".")[0] in ("ectransfer", "services", "tools", "epd")}
    assert not bad, f"peerauth (deployment security) must import neither the library nor the services: {bad}"


def test_services_reach_tooling_only_from_the_commands_that_are_tooling():
    """``epd tiny-model`` and ``epd demo`` are tooling themselves; no serving module imports ``tools``."""
    allowed = {"services/cli.py", "services/demo.py"}
    users = {str(p.relative_to(ROOT)) for p in (ROOT / "services").rglob("*.py")
             if any(m.split(".")[0] == "tools" for m in imported_modules(p))}
    assert users <= allowed, f"serving code imports tools/: {sorted(users - allowed)}"


def test_the_command_and_the_gateway_load_neither_torch_nor_vllm():
    """``epd gateway`` (and ``epd --help``) stay light: the command's top-level imports and the gateway's
    whole module tree import neither torch nor vLLM (nor transformers)."""

    code = ("import sys, services.cli, services.gateway.server; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


SPAWNERS = {"run", "Popen", "call", "check_call", "check_output"}


def test_every_product_spawn_passes_an_explicit_environment():
    """``env=None`` lets a vfork'ed child exec with the global ``environ`` another thread may be
    reallocating (EFAULT; services/common/spawn.py): every process the project starts gets a copy."""
    offenders = []
    for folder in ("services", "ectransfer", "peerauth", "tools", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                        and node.func.attr in SPAWNERS and not any(k.arg == "env" for k in node.keywords)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"spawned without env= (use services.common.spawn.child_env): {offenders}"


def _code_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """The strings ``path``'s code holds (string constants, f-string parts, attribute, keyword, variable
    and argument names), with their line; docstrings (a string standing alone as a statement) left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
    return out


def test_only_the_lms_handoff_module_touches_kv_transfer_params():
    """vLLM's ``kv_transfer_params`` (the request field that names a prefill engine, the output's
    params for a decode engine) have one owner on the LM: ``services/lm/handoff.py`` reads, strips, sets
    and reports them; no other module of the LM or of the transfer library names them in code."""
    owner = ROOT / "services" / "lm" / "handoff.py"
    assert any("kv_transfer_params" in s for _, s in _code_names(owner))
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for folder in (ROOT / "services" / "lm", ROOT / "ectransfer")
                 for path in sorted(folder.rglob("*.py")) if path != owner
                 for line, s in _code_names(path) if "kv_transfer_params" in s]
    assert not offenders, f"kv_transfer_params outside services/lm/handoff.py: {offenders}"


def test_the_lms_request_context_and_media_make_no_import_circle():
    """``services.lm.context`` holds a ``RequestMedia``; ``services.lm.media`` reads the context through
    its own ``RequestItems`` protocol and imports no context (not even for type checking)."""
    lm = ROOT / "services" / "lm"
    assert "services.lm.context" not in imported_modules(lm / "media.py")
