"""dtypeaudit scan versus what a user writes today, as whole processes in one run.

Baseline: ``torch.load(path, weights_only=True, mmap=True)`` then a walk over the dtypes.
Targets (issue 2): wall time <= 0.1x, peak memory <= 0.25x, and scan time flat as the
checkpoint grows 10x.

    python benchmarks/bench_scan.py            # ~1.2 GB and ~0.12 GB checkpoints under benchmarks/_work
"""

from __future__ import annotations

import argparse

from common import WORK, make_transformer_checkpoint, measure, python

BASELINE = (
    "import sys, torch, collections\n"
    "sd = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
    "print(collections.Counter(str(v.dtype) for v in sd.values()))\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    big = make_transformer_checkpoint(WORK / "llama_like_big.pt", hidden=1024, layers=24)
    small = make_transformer_checkpoint(WORK / "llama_like_small.pt", hidden=320, layers=24, vocab=3000)
    ours_big = measure([python(), "-m", "dtypeaudit", "scan", str(big), "--format", "json"], repeat=args.repeat)
    ours_small = measure([python(), "-m", "dtypeaudit", "scan", str(small), "--format", "json"], repeat=args.repeat)
    base_big = measure([python(), "-c", BASELINE, str(big)], repeat=args.repeat)
    gb = big.stat().st_size / 1e9
    sgb = small.stat().st_size / 1e9
    print(f"checkpoints: {big.name} ({gb:.2f} GB), {small.name} ({sgb:.2f} GB)")
    print(f"{'':28}{'wall s':>10}{'peak RSS MB':>14}")
    print(f"{'torch.load mmap + walk':28}{base_big.wall_s:10.2f}{base_big.peak_rss_mb:14.0f}")
    print(f"{f'dtypeaudit scan ({gb:.2f} GB)':28}{ours_big.wall_s:10.2f}{ours_big.peak_rss_mb:14.0f}")
    print(f"{f'dtypeaudit scan ({sgb:.2f} GB)':28}{ours_small.wall_s:10.2f}{ours_small.peak_rss_mb:14.0f}")
    print(f"wall ratio   {ours_big.wall_s / base_big.wall_s:.3f}x   (target <= 0.1x)")
    print(f"memory ratio {ours_big.peak_rss_mb / base_big.peak_rss_mb:.3f}x   (target <= 0.25x)")
    print(f"{gb / sgb:.0f}x growth  {ours_big.wall_s / ours_small.wall_s:.2f}x scan time   (target: flat, ~1.0x)")


if __name__ == "__main__":
    main()
