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
    python benchmarks/bench_many.py --s3-only       # only the 1,000 objects on moto's S3 server

Then the same scan of 1,000 of them as objects on moto's S3 server, started by the script on 127.0.0.1
(``scan s3://bench/many/``, through s3fs and AWS_ENDPOINT_URL as against AWS): target under 20 s, with
peak RSS.
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
    parser.add_argument("--s3-objects", type=int, default=1_000, help="objects on the local S3 server (0: skip that part)")
    parser.add_argument("--s3-only", action="store_true", help="only the S3 part")
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make is not None:
        _write_tree(args.make, args.files)
        return
    if args.s3_only:
        bench_s3(args.s3_objects, args.repeat)
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
    if args.s3_objects:
        bench_s3(args.s3_objects, args.repeat)


def bench_s3(objects: int, repeat: int) -> None:
    """``dtypeaudit scan s3://bench/many/`` over ``objects`` checkpoints on moto's S3 server, started here on
    127.0.0.1 and reached through AWS_ENDPOINT_URL as a user reaches AWS. Target (issue 12): under 20 s for 1,000."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    tree = make_tree(WORK / "many" / str(objects), objects)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "AKIABENCHMARK0000000",
            "AWS_SECRET_ACCESS_KEY": "bench-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
    )
    try:
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket="bench")
        started = time.perf_counter()
        files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.name.startswith("."))
        for p in files:
            client.upload_file(str(p), "bench", f"many/{p.relative_to(tree).as_posix()}")
        uploaded = time.perf_counter() - started
        out = WORK / "many_s3.json"
        cmd = [python(), "-m", "dtypeaudit", "scan", "s3://bench/many/", "--format", "json", "-o", str(out)]
        m = measure_all({"s3": (cmd, out)}, repeat=repeat)["s3"]
        read, failed = _count(out)
    finally:
        server.stop()
    print(f"\n{len(files)} objects on moto's S3 server (uploaded in {uploaded:.0f} s); median of {repeat} runs")
    print(f"{'':34}{'wall s':>10}{'objects/s':>10}{'peak RSS MB':>14}{'peak anon MB':>14}{'report MB':>12}")
    row = f"{m.wall_s:10.2f}{objects / m.wall_s:10.0f}{m.peak_rss_mb:14.0f}{m.peak_anon_mb:14.0f}{m.output_bytes / 1e6:12.1f}"
    print(f"{'scan s3://bench/many/':34}{row}")
    if read != objects or failed:
        raise SystemExit(f"the report lists {read} checkpoints ({failed} unreadable), expected {objects} readable")
    print(f"target: < 20 s for 1,000 objects -> {'met' if m.wall_s < 20 else 'MISSED'}")


if __name__ == "__main__":
    main()
