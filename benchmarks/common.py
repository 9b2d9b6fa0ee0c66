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
    """Peak anonymous memory (RssAnon, polled): RSS less the file pages an mmap maps in."""


def _anon_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(cmd: list[str], *, repeat: int = 3, output: Path | None = None) -> Measurement:
    """Median wall time, largest peak RSS and largest peak anonymous memory over ``repeat`` whole-process runs.

    ``output`` is removed before each run, so that no run pays for freeing the previous run's file.
    """
    walls, peaks, anons = [], [], []
    for _ in range(repeat):
        if output is not None:
            output.unlink(missing_ok=True)
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
        walls.append(time.perf_counter() - start)
        if os.waitstatus_to_exitcode(status) not in (0, 1):
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"command failed: {' '.join(cmd)}\n{err}")
        peaks.append(usage.ru_maxrss / 1024)
        anons.append(anon / 1024)
    return Measurement(statistics.median(walls), max(peaks), max(anons))


def python() -> str:
    return sys.executable


if __name__ == "__main__":
    _write_checkpoint(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
