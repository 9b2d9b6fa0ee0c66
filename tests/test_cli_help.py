"""Every command's --help, byte for byte, as recorded: the help texts and examples of the annotated commands
(cli.py) as Typer prints them. Regenerate on purpose only, with REGENERATE_HELP=1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dtypeaudit.cli import app

GOLDEN = Path(__file__).parent / "golden" / "help"
COMMANDS = [[], ["scan"], ["convert"], ["diff"], ["trace"], ["tune"], ["targets"], ["policy"]]
COMMANDS += [["policy", "init"], ["policy", "validate"], ["policy", "presets"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "root")
def test_help_is_unchanged(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100", "NO_COLOR": "1", "TERM": "xterm"}, prog_name="dtypeaudit")
    assert result.exit_code == 0, result.output
    golden = GOLDEN / ("-".join(["dtypeaudit", *command]) + ".txt")
    if os.environ.get("REGENERATE_HELP"):
        golden.write_text(result.stdout)
    assert result.stdout == golden.read_text()


@pytest.mark.parametrize("command", [["scan"], ["convert"]])
def test_the_preset_list_in_help_is_every_shipped_preset(command: list[str]) -> None:
    from dtypeaudit.policy import preset_names

    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "xterm"}, prog_name="dtypeaudit")
    text = " ".join(result.stdout.split())
    assert "fp8-serving" in preset_names()
    for name in preset_names():
        assert f"{name}," in text or f"{name}." in text, name
