"""Small helpers shared by the tests: our inventory in the oracle's shapes, the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dtypeaudit`` as a separate process, exactly as a CI step would."""
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "dtypeaudit", *args], capture_output=True, text=True, cwd=cwd, env=full_env, timeout=300)


def json_report(*args: str, **kw: Any) -> tuple[int, dict[str, Any], str]:
    proc = run_cli(*args, "--format", "json", **kw)
    return proc.returncode, json.loads(proc.stdout), proc.stderr
