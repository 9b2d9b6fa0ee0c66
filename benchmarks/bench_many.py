"""Many small checkpoints: ``dtypeaudit scan DIR`` over 10,000 files as one whole process.

The tree: 10,000 small checkpoints (half ``torch.save`` zip archives, half safetensors files), 10 in
each of 1,000 folders two levels deep (``shard_XXX/group_Y/``), each a Linear-plus-LayerNorm state_dict
of 5 tensors in float32, float16 or bfloat16. ``scan DIR`` walks a plain directory and decides by content which files to read, so no
``--recursive`` flag is needed. Made once under benchmarks/_work/many (about 20 s, 80 MB).

Measured: wall time and peak RSS (the process and its workers) of ``dtypeaudit scan DIR --format json
-o FILE``, at the default ``--jobs`` (one process per core) and at ``--jobs 1``, and the same at a
tenth of the files: memory flat means the 10x tree costs no more than the 1x tree beyond the report
itself. Target (issue 12): under 10 s for 10,000 files, memory flat.

    python benchmarks/bench_many.py                 # 10,000 files and 1,000 files
    python benchmarks/bench_many.py --files 2000    # a smaller tree
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import WORK, measure_all, python


def make_tree(root: Path, files: int) -> Path:
    """``files`` checkpoints under ``root`` (made in a child process, so that this one stays small)."""
    marker = root / ".complete"
    if marker.exists() and marker.read_text() == str(files):
        return root
    subprocess.run([sys.executable, __file__, "--make", str(root), "--files", str(files)], check=True)
    return root


def _write_tree(root: Path, files: int) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    if root.exists():
        shutil.rmtree(root)
    g = torch.Generator().manual_seed(0)
    for i in range(files):
        folder = root / f"shard_{i // 100:03d}" / f"group_{i % 100 // 10}"
        folder.mkdir(parents=True, exist_ok=True)
        dtype = (torch.float32, torch.float16, torch.bfloat16)[i % 3]
        state = {
            "fc.weight": torch.randn(16, 8, generator=g).to(dtype),
            "fc.bias": torch.zeros(16, dtype=dtype),
            "norm.weight": torch.ones(16),
            "norm.bias": torch.zeros(16),
            "step": torch.tensor(i),
        }
        if i % 2:
            save_file(state, folder / f"ckpt_{i:05d}.safetensors")
        else:
            torch.save(state, folder / f"ckpt_{i:05d}.pt")
    (root / ".complete").write_text(str(files))


def _count(report: Path) -> tuple[int, int]:
    data = json.loads(report.read_text())
    checkpoints = data["checkpoints"]
    return len(checkpoints), sum(1 for c in checkpoints if c["error"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make is not None:
        _write_tree(args.make, args.files)
        return
    small_n = max(1, args.files // 10)
    big = make_tree(WORK / "many" / str(args.files), args.files)
    small = make_tree(WORK / "many" / str(small_n), small_n)
    out = {label: WORK / f"many_{label}.json" for label in ("big", "big_j1", "small")}
    scan = [python(), "-m", "dtypeaudit", "scan"]
    # measure_all removes every command's output before each run: the one run last leaves its report to check
    commands = {
        "small": ([*scan, str(small), "--format", "json", "-o", str(out["small"])], out["small"]),
        "big_j1": ([*scan, str(big), "--format", "json", "--jobs", "1", "-o", str(out["big_j1"])], out["big_j1"]),
        "big": ([*scan, str(big), "--format", "json", "-o", str(out["big"])], out["big"]),
    }
    started = time.perf_counter()
    runs = measure_all(commands, repeat=args.repeat)
    elapsed = time.perf_counter() - started
    cores = os.cpu_count() or 1
    print(f"{args.files} files ({small_n} for the 1x row), {cores} cores; medians of {args.repeat} runs ({elapsed:.0f} s in all)")
    print(f"{'':34}{'wall s':>10}{'files/s':>10}{'peak RSS MB':>14}{'peak anon MB':>14}{'report MB':>12}")
    for label, n, name in (
        ("small", small_n, f"scan {small_n} files (default jobs)"),
        ("big", args.files, f"scan {args.files} files (default jobs)"),
        ("big_j1", args.files, f"scan {args.files} files (--jobs 1)"),
    ):
        m = runs[label]
        print(f"{name:34}{m.wall_s:10.2f}{n / m.wall_s:10.0f}{m.peak_rss_mb:14.0f}{m.peak_anon_mb:14.0f}{m.output_bytes / 1e6:12.1f}")
    read, failed = _count(out["big"])
    if read != args.files or failed:
        raise SystemExit(f"the report lists {read} checkpoints ({failed} unreadable), expected {args.files} readable")
    print(f"target: < 10 s for 10,000 files -> {'met' if runs['big'].wall_s < 10 else 'MISSED'}")
    per = (runs["big"].peak_rss_mb - runs["small"].peak_rss_mb) / (args.files - small_n) * 1000
    print(f"memory: {runs['big'].peak_rss_mb / runs['small'].peak_rss_mb:.1f}x for 10x the files, {per:.0f} KB more per checkpoint")
    # TODO(remote): 1,000 objects on the local S3 test server (moto) in under 20 s, once `scan s3://...` exists:
    # start `moto_server` on 127.0.0.1, upload the 1,000-file tree with s3fs, then time
    # `dtypeaudit scan s3://bucket/many/ --format json -o FILE` as above (AWS_ENDPOINT_URL pointing at it).


if __name__ == "__main__":
    main()
