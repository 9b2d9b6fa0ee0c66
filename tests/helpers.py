"""Small helpers shared by the tests: our inventory in the oracle's shapes, the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from dtypeaudit.inventory import Inventory

ROOT = Path(__file__).resolve().parent.parent


def facts(inv: Inventory) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {t.name: (t.dtype, t.shape, t.kind) for t in inv.tensors}


def sharing(inv: Inventory) -> set[frozenset[str]]:
    """Groups of names sharing a storage, leaving out empty tensors (as the oracle must)."""
    empty = {t.name for t in inv.tensors if t.numel == 0}
    groups = {frozenset((t.name, *t.shares_with)) - empty for t in inv.tensors if t.shares_with and t.name not in empty}
    return {g for g in groups if len(g) > 1}


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, process: bool = False
) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: exit status, stdout (the report) and stderr (logs) apart.

    By default in this process, through Typer's CliRunner: the same app the console script runs, without a
    second of interpreter and import start-up per call. ``process=True`` runs ``python -m dtypeaudit`` as a
    separate process, for the tests where the process is the point (signals, what gets imported, a hard exit).
    """
    if process:
        full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", **(env or {})}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        command = [sys.executable, "-m", "dtypeaudit", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=full_env, timeout=300)
    from typer.testing import CliRunner

    from dtypeaudit import cli
    from dtypeaudit.formats import remote

    remote.forget()  # a fresh process would know no remote listing yet
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli.app, list(args), env={"NO_COLOR": "1", "COLUMNS": "160", **(env or {})}, prog_name="dtypeaudit")
    finally:
        os.chdir(here)
    stderr, code = result.stderr, result.exit_code
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # What the interpreter would print and return for an exception that escaped the command.
        stderr += "".join(traceback.format_exception(result.exception))
        code = 1
    return subprocess.CompletedProcess(["dtypeaudit", *args], code, result.stdout, stderr)


def json_report(*args: str, **kw: Any) -> tuple[int, dict[str, Any], str]:
    proc = run_cli(*args, "--format", "json", **kw)
    return proc.returncode, json.loads(proc.stdout), proc.stderr
