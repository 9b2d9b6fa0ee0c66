"""dtypeaudit convert --to fp16 versus what a user writes today, and versus cp (the I/O floor), in one run.

Baseline: ``sd = torch.load(p, weights_only=True); torch.save({k: v.half() for k, v in sd.items()}, out)``.
Targets (issue 4): wall time <= 0.5x the naive script, peak anonymous memory <= 0.25x of it.
For each checkpoint the three commands run interleaved, five times each: medians of wall time, peaks
of memory. Two Llama-shaped fp32 checkpoints: 1.9 GB and 3.7 GB (both are made once under
benchmarks/_work; the larger takes half a minute). Both processes pay the same second to import torch,
so the ratio falls as the checkpoint grows.

    python benchmarks/bench_convert.py            # both sizes
    python benchmarks/bench_convert.py --small    # the 1.9 GB one only
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import WORK, make_transformer_checkpoint, measure_all, python

NAIVE = (
    "import sys, torch\n"
    "sd = torch.load(sys.argv[1], weights_only=True)\n"
    "torch.save({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, sys.argv[2])\n"
)


def compare(src: Path, repeat: int) -> None:
    out, naive_out, copy_out = WORK / "converted.pt", WORK / "naive.pt", WORK / "copy.pt"
    runs = measure_all(
        {
            "ours": ([python(), "-m", "dtypeaudit", "convert", str(src), "--to", "fp16", "-o", str(out)], out),
            "naive": ([python(), "-c", NAIVE, str(src), str(naive_out)], naive_out),
            "cp": (["cp", str(src), str(copy_out)], copy_out),
        },
        repeat=repeat,
    )
    ours, naive, cp = runs["ours"], runs["naive"], runs["cp"]
    print(f"checkpoint: {src.name} ({src.stat().st_size / 1e9:.2f} GB fp32 -> {ours.output_bytes / 1e9:.2f} GB fp16)")
    print(f"{'':32}{'wall s':>9}{'peak RSS MB':>13}{'peak anon MB':>14}")
    for label, m in (("naive torch.load + half + save", naive), ("dtypeaudit convert", ours), ("cp (I/O floor)", cp)):
        print(f"{label:32}{m.wall_s:9.2f}{m.peak_rss_mb:13.0f}{m.peak_anon_mb:14.0f}")
    print(f"wall ratio        {ours.wall_s / naive.wall_s:.3f}x   (target <= 0.5x)")
    print(f"anon memory ratio {ours.peak_anon_mb / naive.peak_anon_mb:.3f}x   (target <= 0.25x)")
    print(f"versus cp         {ours.wall_s / cp.wall_s:.2f}x\n")
    for p in (out, naive_out, copy_out):
        p.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="only the 1.9 GB checkpoint")
    args = parser.parse_args()
    checkpoints = [make_transformer_checkpoint(WORK / "llama_like_big.pt", hidden=1024, layers=24)]
    if not args.small:
        checkpoints.append(make_transformer_checkpoint(WORK / "llama_like_4gb.pt", hidden=2048, layers=12))
    for src in checkpoints:
        compare(src, args.repeat)


if __name__ == "__main__":
    main()
