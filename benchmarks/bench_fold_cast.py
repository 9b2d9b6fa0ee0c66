"""One thread, seconds per GB of float32 read: the value checks' fold (``values.ValueCheck.fold``), the cast
(``npcast.NumpyCaster``) and the two as a conversion's piece makes them (``pieces.Maker``: fold, then the cast
given what the fold found), for float16 and bfloat16 targets, on weight-like values (N(0, 0.02) float32), a
chunk (``values.CHUNK_BYTES``) at a time over tensors of ``--mb`` MB.

With ``--before DIR`` (an export of an earlier commit's tree, ``git archive REV dtypeaudit | tar -x -C DIR``) the
same steps of that tree's ``values.py`` and ``npcast.py`` are timed too, interleaved round by round in this
process, and their figures compared (ValueStats must be equal, the cast's bytes identical). Each figure is the
fastest of ``--rounds`` rounds: on a shared machine the fastest is the least disturbed.

    python benchmarks/bench_fold_cast.py --mb 16 --rounds 9 --before /tmp/before
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np


def load(tree: Path, tag: str) -> tuple[ModuleType, ModuleType]:
    """``values`` and ``npcast`` of the tree ``tree`` (neither imports the rest of the package at module level)."""
    loaded = []
    for name in ("values", "npcast"):
        spec = importlib.util.spec_from_file_location(f"{tag}_{name}", tree / "dtypeaudit" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def timed(
    values: ModuleType, npcast: ModuleType, target: str, step: str, tensors: list[Any], *, crc: bool = False
) -> tuple[float, Any, int]:
    """Seconds for one pass of ``step`` over ``tensors``, the last tensor's stats and (``crc``: then not timed) the
    CRC of the cast bytes."""
    chunk = values.CHUNK_BYTES // 4
    check, caster = values.ValueCheck(), npcast.NumpyCaster("float32", target, capacity=chunk)
    total, stats = 0, None
    start = time.perf_counter()
    for tensor in tensors:
        stats = values.ValueStats("", "float32", target)
        for first in range(0, len(tensor), chunk):
            x = tensor[first : first + chunk]
            looked = check.fold(stats, x, x) if step != "cast" else None
            if step != "fold":
                with np.errstate(over="ignore", invalid="ignore"):
                    out = caster(x, looked)
                if crc:
                    total = zlib.crc32(out, total)
    return time.perf_counter() - start, stats, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=16, help="MB per tensor")
    parser.add_argument("--tensors", type=int, default=8, help="tensors per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--before", type=Path, help="an earlier tree to time beside this one")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tensors = [(rng.standard_normal(args.mb << 18, dtype=np.float32) * np.float32(0.02)) for _ in range(args.tensors)]
    gb = sum(t.nbytes for t in tensors) / 1e9
    trees = {"this tree": load(Path(__file__).resolve().parent.parent, "now")}
    if args.before is not None:
        trees = {"before": load(args.before, "before"), **trees}
    steps = [(target, step) for target in ("float16", "bfloat16") for step in ("fold", "cast", "fold+cast")]
    best: dict[tuple[str, str, str], float] = {}
    results: dict[tuple[str, str, str], tuple[Any, int]] = {}
    for _ in range(args.rounds):
        for target, step in steps:
            for tree, (values, npcast) in trees.items():
                seconds, _, _ = timed(values, npcast, target, step, tensors)
                key = (tree, target, step)
                best[key] = min(best.get(key, float("inf")), seconds / gb)
    for target, step in steps:
        for tree, (values, npcast) in trees.items():
            _, stats, crc = timed(values, npcast, target, step, tensors, crc=True)
            results[(tree, target, step)] = (vars(stats), crc)
    print(f"s/GB of float32, one thread, {args.mb} MB tensors, {values.CHUNK_BYTES >> 10} KiB chunks, fastest of {args.rounds}")
    for target, step in steps:
        row = "  ".join(f"{tree} {best[(tree, target, step)]:.3f}" for tree in trees)
        if args.before is not None:
            ratio = best[("this tree", target, step)] / best[("before", target, step)]
            same = results[("this tree", target, step)] == results[("before", target, step)]
            row += f"  ratio {ratio:.2f}  {'same figures and bytes' if same else 'DIFFERENT RESULTS'}"
        print(f"{target:9s} {step:10s} {row}")


if __name__ == "__main__":
    main()
