"""Scanning: expand what the user named into checkpoints, read each, and gather one report."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .check import Check
from .errors import DtypeAuditError, UsageError
from .formats import directory, read_checkpoint
from .formats import factory as factory_mod
from .inventory import CheckpointReport, Inventory, Report, Severity

CHECKPOINT_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar", ".model", ".pkl", ".pickle"})
PARALLEL_THRESHOLD = 4


def expand(targets: Iterable[str]) -> list[str]:
    """Files, checkpoint directories, plain directories (searched for checkpoints) and globs, in order, once each."""
    out: list[str] = []
    for target in targets:
        if factory_mod.looks_like_factory(target):
            out.append(target)
            continue
        matches = sorted(glob.glob(target, recursive=True)) if glob.has_magic(target) else [target]
        if not matches:
            raise UsageError(f"no file matches '{target}'")
        for m in matches:
            out.extend(_expand_one(Path(m)))
    unique: dict[str, str] = {}
    for p in out:
        unique.setdefault(os.path.realpath(p) if os.path.exists(p) else p, p)
    return list(unique.values())


def _expand_one(path: Path) -> list[str]:
    if not path.is_dir() or (path / ".metadata").is_file() or directory.is_model_directory(path):
        return [str(path)]
    found: list[str] = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        here = Path(root)
        if here != path and ((here / ".metadata").is_file() or directory.find_index(here)):
            found.append(str(here))
            dirs.clear()
            continue
        found.extend(str(here / f) for f in sorted(files) if Path(f).suffix.lower() in CHECKPOINT_SUFFIXES)
    if not found:
        raise UsageError(f"no checkpoints found under directory '{path}'")
    return found


def read_target(target: str) -> Inventory:
    if factory_mod.looks_like_factory(target):
        return factory_mod.inventory(target)
    return read_checkpoint(target)


def _read_safely(target: str) -> Inventory | str:
    try:
        return read_target(target)
    except DtypeAuditError as exc:
        return exc.one_line()


def _read_raising(target: str) -> Inventory | str:
    return read_target(target)


def scan(
    targets: Sequence[str],
    *,
    checks: Sequence[Check] = (),
    model: str | None = None,
    fail_on: Severity = "error",
    policy_name: str | None = None,
    jobs: int | None = None,
    raise_errors: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> Report:
    """Read every target, attach the model's kinds if given, run the checks, and report.

    An unreadable checkpoint becomes an entry with ``error`` set, unless ``raise_errors``.
    """
    reader = _read_raising if raise_errors else _read_safely
    paths = expand(targets)
    model_inv = factory_mod.inventory(model) if model else None
    results: list[Inventory | str]
    if len(paths) >= PARALLEL_THRESHOLD and (jobs or os.cpu_count() or 1) > 1 and jobs != 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs or min(len(paths), os.cpu_count() or 1)) as pool:
            results = []
            for i, result in enumerate(pool.map(reader, paths)):
                results.append(result)
                if progress:
                    progress(i + 1, len(paths), paths[i])
    else:
        results = []
        for i, p in enumerate(paths):
            results.append(reader(p))
            if progress:
                progress(i + 1, len(paths), p)
    reports = []
    for path, result in zip(paths, results, strict=True):
        if isinstance(result, str):
            reports.append(CheckpointReport(path=path, format=None, error=result, inventory=None))
            continue
        inv = factory_mod.attach(result, model_inv) if model_inv and result.format != "factory" else result
        findings = list(inv.findings)
        for check in checks:
            findings.extend(check(inv))
        reports.append(CheckpointReport(path=path, format=inv.format, error=None, inventory=inv, findings=tuple(findings)))
    return Report(tuple(reports), fail_on=fail_on, policy=policy_name)
