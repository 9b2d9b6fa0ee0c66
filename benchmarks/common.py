"""Shared by the benchmarks: a transformer-shaped checkpoint and whole-process measurements."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORK = Path(__file__).resolve().parent / "_work"


def make_transformer_checkpoint(path: Path, *, hidden: int, layers: int, vocab: int = 32000) -> Path:
    """A Llama-shaped fp32 state_dict saved with torch.save, made in a child process.

    A child, so that this process stays small: a forked measurement child would otherwise
    inherit this process's peak RSS.
    """
    if not path.exists():
        subprocess.run(
            [sys.executable, __file__, str(path), str(hidden), str(layers), str(vocab)],
            check=True,
        )
    return path


def _write_checkpoint(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02}
    for i in range(layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{p}.self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g) * 0.02
        state[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, shape in (("gate_proj", (4 * hidden, hidden)), ("up_proj", (4 * hidden, hidden)), ("down_proj", (hidden, 4 * hidden))):
            state[f"{p}.mlp.{name}.weight"] = torch.randn(*shape, generator=g) * 0.02
    state["model.norm.weight"] = torch.ones(hidden)
    state["lm_head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.02
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)
    return path


@dataclass(frozen=True)
class Measurement:
    wall_s: float
    peak_rss_mb: float
    peak_anon_mb: float
    """Peak anonymous memory (RssAnon of the process and its children, polled): RSS less the file pages an mmap maps in."""
    output_bytes: int = 0
    """The size of what the command wrote, when it names an output."""


def _anon_kb(pid: int) -> int:
    """RssAnon of ``pid`` and the processes its main thread started (dtypeaudit convert reads values in a
    child). Cheap on purpose: this runs every 10 ms on the same two cores as the command it measures."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1])
                    break
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            total += sum(_anon_kb(int(child)) for child in fh.read().split())
    except OSError:
        pass
    return total


@dataclass(frozen=True)
class Run:
    """One whole-process run of a command."""

    wall_s: float
    cpu_s: float
    """user + sys of the process and the children it waited for."""
    peak_rss_mb: float
    peak_anon_mb: float
    output_bytes: int


def run_once(cmd: list[str], output: Path | None, outputs: list[Path]) -> Run:
    """Run ``cmd`` once, polling its anonymous memory; every path in ``outputs`` is removed first."""
    # Every command's output goes before every run: no run pays for freeing an earlier file, and each
    # starts with the same page cache (here a cached 1.9 GB copy made the next torch.load run 2x slower).
    for earlier in outputs:
        earlier.unlink(missing_ok=True)
    os.sync()  # start each run without another run's dirty pages to flush
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    anon = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        anon = max(anon, _anon_kb(proc.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{err}")
    size = output.stat().st_size if output is not None and output.exists() else 0
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, anon / 1024, size)


def measure_all(commands: dict[str, tuple[list[str], Path | None]], *, repeat: int = 3) -> dict[str, Measurement]:
    """Whole-process runs of every command, interleaved (A B C, A B C, ...) so that a drifting machine
    touches each alike: median wall time, largest peak RSS, largest peak anonymous memory (with children).

    Every command's ``output`` is removed before each run.
    """
    runs: dict[str, list[Run]] = {label: [] for label in commands}
    outputs = [output for _, output in commands.values() if output is not None]
    for _ in range(repeat):
        for label, (cmd, output) in commands.items():
            runs[label].append(run_once(cmd, output, outputs))
    return {
        label: Measurement(
            statistics.median(r.wall_s for r in rs),
            max(r.peak_rss_mb for r in rs),
            max(r.peak_anon_mb for r in rs),
            max(r.output_bytes for r in rs),
        )
        for label, rs in runs.items()
    }


def measure(cmd: list[str], *, repeat: int = 3, output: Path | None = None) -> Measurement:
    """``measure_all`` for one command."""
    return measure_all({"": (cmd, output)}, repeat=repeat)[""]


def python() -> str:
    return sys.executable


if __name__ == "__main__":
    _write_checkpoint(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
