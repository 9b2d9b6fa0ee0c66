"""Small helpers shared by the tests: our inventory in the oracle's shapes, the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtypeaudit.inventory import Inventory, TensorRecord

if TYPE_CHECKING:
    import torch
    from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def facts(inv: Inventory) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {t.name: (t.dtype, t.shape, t.kind) for t in inv.tensors}


def sharing(inv: Inventory) -> set[frozenset[str]]:
    """Groups of names sharing a storage, leaving out empty tensors (as the oracle must)."""
    empty = {t.name for t in inv.tensors if t.numel == 0}
    groups = {frozenset((t.name, *t.shares_with)) - empty for t in inv.tensors if t.shares_with and t.name not in empty}
    return {g for g in groups if len(g) > 1}


def inventory_of(model: nn.Module, *, facts: bool, prefix: str = "") -> Inventory:
    """The records a reader makes of ``model.state_dict()``, with module types and the norms' measured forwards
    when ``facts`` (as --model gives)."""
    from dtypeaudit.formats import factory

    owners = {name: type(m).__name__ for name, m in model.named_modules()}
    records = tuple(
        TensorRecord(
            prefix + name,
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.numel() * t.element_size(),
            module=owners.get(name.rpartition(".")[0]) if facts else None,
        )
        for name, t in model.state_dict().items()
    )
    probes = factory.probe_norms(model) if facts else {}
    return Inventory("<memory>", "test", records, metadata={"module_forward": probes} if probes else {})


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


# -- checkpoints the tests write (torch imported where they are written) ----------------------------------------


def all_dtypes_state() -> dict[str, torch.Tensor]:
    """A tensor of every dtype torch.save writes, views and a transposed one over one storage, a scalar, an empty one."""
    import torch
    from torch import nn

    from .oracle import SAVABLE_DTYPES

    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {f"t_{name}": torch.zeros(2, 3, dtype=getattr(torch, name)) for name in SAVABLE_DTYPES}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state["base"] = base
    state["row_view"] = base[2]
    state["col_view"] = base[:, 1]
    state["transposed"] = base.t()
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.empty(0, 5)
    state["param"] = nn.Parameter(torch.ones(3))
    return state


def write_sharded(directory: Path, state: dict[str, torch.Tensor], shards: int, *, kind: str = "safetensors") -> Path:
    """Write ``state`` the way transformers' save_pretrained shards it: numbered shards and an index."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        chunk = {n: state[n].contiguous() for n in names[i * per : (i + 1) * per]}
        if kind == "safetensors":
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(chunk, str(directory / fname), metadata={"format": "pt"})
        else:
            fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            torch.save(chunk, directory / fname)
        for n, t in chunk.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index_name = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (directory / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (directory / "config.json").write_text(json.dumps({"architectures": ["TinyLM"], "torch_dtype": "float32"}))
    return directory
