"""Small helpers shared by the tests: our inventory in the oracle's shapes, the CLI as a user runs it."""

from __future__ import annotations

import collections
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
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


# -- a Range-honouring HTTP server, for remote reads and conversions -------------------------------------------------


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """``/files/<name>`` as a static server with ranges; ``/error500/``, ``/flaky/`` (503 once per path),
    ``/slow/`` (answers after 2 s) and ``/norange/`` (ignores Range) for the failures. Query strings are ignored."""

    root: Path
    served: collections.Counter[str]
    requests: collections.Counter[str]
    lock = threading.Lock()
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms wait for the ACK

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: bool) -> None:
        mode, _, name = self.path.split("?", 1)[0].lstrip("/").partition("/")
        with self.lock:
            self.requests[self.path.split("?", 1)[0]] += 1
            first = self.requests[self.path.split("?", 1)[0]] == 1
        if mode == "error500" or (mode == "flaky" and first):
            self.send_response(500 if mode == "error500" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "slow":
            time.sleep(2)
        path = self.root / name
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m and mode != "norange":
            start, end = int(m.group(1)), min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if body:
            with path.open("rb") as f:
                f.seek(start)
                left = end - start + 1
                while left > 0:
                    chunk = f.read(min(left, 1 << 20))
                    with self.lock:  # counted before it is sent, so a client that has it sees it counted
                        self.served[name] += len(chunk)
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    left -= len(chunk)

    def do_HEAD(self) -> None:
        self._answer(False)

    def do_GET(self) -> None:
        self._answer(True)


@contextmanager
def serve_folder(root: Path) -> Iterator[tuple[str, type[RangeHandler]]]:
    """``root`` served over HTTP on a free local port while the block runs: the server's base URL (files under
    ``/files/``) and its handler class, whose ``served`` and ``requests`` count what was asked of it."""
    handler = type("Handler", (RangeHandler,), {"root": root, "served": collections.Counter(), "requests": collections.Counter()})
    server_class = type("Server", (http.server.ThreadingHTTPServer,), {"request_queue_size": 128, "daemon_threads": True})
    server = server_class(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
