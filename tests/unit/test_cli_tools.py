"""The commands that are tooling (``epd tiny-model``, the built-in tiny model) take ``tools/`` from the
checkout (services/cli.py, ``use_checkout_tools``): without one, as from an installed wheel, they refuse
with a clear error and exit 2 before anything is written."""

from __future__ import annotations

import pytest

from services import cli

pytestmark = pytest.mark.unit


def test_without_a_checkout_the_tiny_model_commands_refuse_with_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path / "site-packages")
    out = tmp_path / "model"
    assert cli.main(["tiny-model", str(out)]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="source checkout's tools/"):
        cli.default_model()


def test_an_unknown_family_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "model"
    assert cli.main(["tiny-model", str(out), "--family", "nope"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
    assert not out.exists()


def test_from_the_checkout_tools_is_the_checkouts_own():
    cli.use_checkout_tools()
    import tools

    assert tools.__file__ == str(cli.CHECKOUT / "tools" / "__init__.py")
