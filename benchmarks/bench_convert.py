"""dtypeaudit convert --to fp16 versus what a user writes today, and versus cp (the I/O floor), in one run.

Baseline: ``sd = torch.load(p, weights_only=True); torch.save({k: v.half() for k, v in sd.items()}, out)``.
Targets (issue 28): wall time <= 0.6x the naive script at 1.5 GB and <= 0.5x at 3 GB, CPU time <= 1x of it,
wall <= 1.5x of cp + sync; peak anonymous memory within the checkpoint's largest tensor. convert fsyncs its output before the rename
(a durable, atomic write is a promise) and neither the naive script nor cp does, so each is also run
followed by ``sync``: the fair comparison for durability. The figures are given both ways.

Both dtypeaudit trees are byte-compiled first, as a regular install is (``byte_compile``). Every command runs as
a whole process, interleaved round by round (A B C..., A B C...), after an
``os.sync()`` and with every earlier output removed. Wall time and CPU time (user + sys of the process
and its children, from ``wait4``) are paired per round: the ratios are medians of per-round ratios,
which a machine shared with other work disturbs less than ratios of medians. Two Llama-shaped fp32
``torch.save`` checkpoints, about 1.5 GB and 3 GB, made once under ``--dir`` (a minute each).
Also timed: ``convert --dry-run`` (the metadata-only plan), ``convert --dry-run --check-values`` and
``scan``, the speed a metadata-only plan should have.

    python benchmarks/bench_convert.py                     # both sizes, 5 rounds, files under /tmp
    python benchmarks/bench_convert.py --sizes 1.5 --repeat 3
    python benchmarks/bench_convert.py --clean             # delete the checkpoints at the end
    python benchmarks/bench_convert.py --before /tmp/old   # also convert with an export of an earlier commit
    python benchmarks/bench_convert.py --sizes 0.05 --repeat 1   # a check that it runs (a 50 MB checkpoint)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from common import Run, make_transformer_checkpoint, python, run_once

NAIVE = (
    "import sys, torch\n"
    "sd = torch.load(sys.argv[1], weights_only=True)\n"
    "torch.save({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, sys.argv[2])\n"
)
NAIVE_SYNC = NAIVE + "import os; os.sync()\n"
SHAPES = {"0.05": (256, 2), "1.5": (1024, 18), "3": (2048, 9)}
"""Checkpoint size in GB -> (hidden, layers) of the Llama-shaped state_dict (54 MB, 1.47 GB and 2.94 GB)."""
WALL_TARGET = {"0.05": 0.6, "1.5": 0.6, "3": 0.5}
"""Issue 28's wall-time target against the naive script, by size (the smallest is only a check that this runs)."""


def median(values: list[float]) -> float:
    return statistics.median(values)


def largest_tensor_mb(src: Path) -> float:
    """The checkpoint's largest tensor, from its metadata (dtypeaudit's reader: no value is read)."""
    from dtypeaudit import read

    return max(t.nbytes for t in read(src).tensors) / 2**20


def compare(src: Path, work: Path, repeat: int, *, wall_target: float, convert_only: bool = False, before: Path | None = None) -> None:
    out, naive_out, copy_out = work / "convspeed_ours.pt", work / "convspeed_naive.pt", work / "convspeed_copy.pt"
    dtypeaudit = [python(), "-m", "dtypeaudit"]
    commands: dict[str, tuple[list[str], Path | None]] = {
        "dtypeaudit convert": ([*dtypeaudit, "convert", str(src), "--to", "fp16", "-o", str(out)], out),
        "naive load + half + save": ([python(), "-c", NAIVE, str(src), str(naive_out)], naive_out),
        "naive + os.sync()": ([python(), "-c", NAIVE_SYNC, str(src), str(naive_out)], naive_out),
        "cp": (["cp", str(src), str(copy_out)], copy_out),
        "cp + sync": (["sh", "-c", 'cp "$0" "$1" && sync', str(src), str(copy_out)], copy_out),
        "convert --dry-run": ([*dtypeaudit, "convert", str(src), "--to", "fp16", "--dry-run"], None),
        "convert --dry-run --check-values": ([*dtypeaudit, "convert", str(src), "--to", "fp16", "--dry-run", "--check-values"], None),
        "scan": ([*dtypeaudit, "scan", str(src)], None),
    }
    if convert_only:  # a build without --check-values (the figures before this change)
        commands = {k: v for k, v in commands.items() if v[1] is not None}
    if before is not None:  # another tree's dtypeaudit (an export of an earlier commit), interleaved with this one
        before_out = work / "convspeed_before.pt"
        # -P (3.11+): without it, ``python -m`` puts the working directory first on sys.path, and run from a checkout
        # it imports that checkout's dtypeaudit instead of PYTHONPATH's (this run compared main with itself until it
        # had -P; on 3.10, run the benchmark from outside the checkout)
        isolated = ["-P"] if sys.version_info >= (3, 11) else []
        before_cli = ["env", f"PYTHONPATH={before}", python(), *isolated, "-m", "dtypeaudit"]
        cmd = [*before_cli, "convert", str(src), "--to", "fp16", "-o", str(before_out)]
        commands["convert (--before tree)"] = (cmd, before_out)
    outputs = [o for _, o in commands.values() if o is not None]
    runs: dict[str, list[Run]] = {label: [] for label in commands}
    for _ in range(repeat):
        for label, (cmd, output) in commands.items():
            runs[label].append(run_once(cmd, output, outputs))
    for o in outputs:
        o.unlink(missing_ok=True)
    ours = runs["dtypeaudit convert"]
    print(f"checkpoint: {src.name} ({src.stat().st_size / 1e9:.2f} GB fp32 -> {ours[0].output_bytes / 1e9:.2f} GB fp16), {repeat} rounds")
    print(f"{'':34}{'wall s':>8}{'cpu s':>8}{'peak anon MB':>14}   (medians; anon: max)")
    for label, rs in runs.items():
        print(f"{label:34}{median([r.wall_s for r in rs]):8.2f}{median([r.cpu_s for r in rs]):8.2f}{max(r.peak_anon_mb for r in rs):14.0f}")

    def ratio(other: str, what: str, mine: str = "dtypeaudit convert") -> str:
        per_round = [getattr(a, what) / getattr(b, what) for a, b in zip(runs[mine], runs[other], strict=True)]
        return f"{median(per_round):.3f}x (rounds {min(per_round):.2f}-{max(per_round):.2f})"

    print(f"wall / naive               {ratio('naive load + half + save', 'wall_s')}   target <= {wall_target}x")
    print(f"wall / naive + sync        {ratio('naive + os.sync()', 'wall_s')}   (both durable)")
    print(f"cpu  / naive               {ratio('naive load + half + save', 'cpu_s')}   target <= 1x")
    print(f"wall / cp                  {ratio('cp', 'wall_s')}   (a copy left in the page cache)")
    print(f"wall / cp + sync           {ratio('cp + sync', 'wall_s')}   target <= 1.5x (both durable)")
    print(f"anon / naive               {ratio('naive load + half + save', 'peak_anon_mb')}")
    largest = largest_tensor_mb(src)
    peak = max(r.peak_anon_mb for r in ours)
    print(f"anon / largest tensor      {peak / largest:.3f}x ({peak:.0f} MB, largest tensor {largest:.0f} MB)   target <= 1x")
    if before is not None:
        earlier = "convert (--before tree)"
        print(f"before: wall / naive       {ratio('naive load + half + save', 'wall_s', earlier)}")
        print(f"before: wall / naive + sync {ratio('naive + os.sync()', 'wall_s', earlier)}")
        print(f"before: cpu  / naive       {ratio('naive load + half + save', 'cpu_s', earlier)}")
        print(f"before: wall / cp + sync   {ratio('cp + sync', 'wall_s', earlier)}")
        print(f"after / before: wall {ratio(earlier, 'wall_s')}, cpu {ratio(earlier, 'cpu_s')}")
    if not convert_only:
        print(f"dry-run / scan             {ratio_of(runs, 'convert --dry-run', 'scan')}   (metadata-only plan: scan speed)")
    print()


def ratio_of(runs: dict[str, list[Run]], a: str, b: str) -> str:
    per_round = [x.wall_s / y.wall_s for x, y in zip(runs[a], runs[b], strict=True)]
    return f"{median(per_round):.3f}x"


def byte_compile(package: Path) -> None:
    """Write the package's bytecode, as a regular install does (pip compiles at install). A run from a checkout
    under PYTHONDONTWRITEBYTECODE=1 (set in some shells, these machines' among them) otherwise compiles every
    module from source on every run: 0.19 s of a 1.47 GB conversion's 2 s, which no user pays twice."""
    subprocess.run([python(), "-m", "compileall", "-q", str(package)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES), help="checkpoint sizes in GB")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the checkpoints and outputs go")
    parser.add_argument("--convert-only", action="store_true", help="leave out the dry runs and scan")
    parser.add_argument("--clean", action="store_true", help="delete the checkpoints at the end")
    parser.add_argument("--before", type=Path, help="also time convert from this tree (e.g. `git archive` of an earlier commit)")
    args = parser.parse_args()
    for tree in (Path(__file__).resolve().parent.parent, args.before):
        if tree is not None:
            byte_compile(tree / "dtypeaudit")
    for size in args.sizes:
        hidden, layers = SHAPES[size]
        src = make_transformer_checkpoint(args.dir / f"convspeed_{size.replace('.', 'p')}gb.pt", hidden=hidden, layers=layers)
        try:
            compare(src, args.dir, args.repeat, wall_target=WALL_TARGET[size], convert_only=args.convert_only, before=args.before)
        finally:
            if args.clean:
                src.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
