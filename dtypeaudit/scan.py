"""Scanning: expand what the user named into checkpoints, read each, and gather one report."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import structure
from .check import Check, strict_findings
from .errors import DtypeAuditError, UsageError
from .formats import directory, read_checkpoint
from .formats import factory as factory_mod
from .formats.sniff import is_candidate
from .inventory import CheckpointReport, Inventory, Report, Severity

if TYPE_CHECKING:
    from .policy import Policy

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


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / ".metadata").is_file() or directory.is_model_directory(path)


def _expand_one(path: Path) -> list[str]:
    """A file or checkpoint directory as named; a plain directory is walked, and every regular file in it
    is looked at by content (not by suffix), skipping what is clearly not a checkpoint."""
    if not path.is_dir() or _is_checkpoint_dir(path):
        return [str(path)]
    found = [str(p) for p in directory.walk_files(path, stop_at=_is_checkpoint_dir) if p.is_dir() or is_candidate(p)]
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
    strict: bool = False,
    policy: Policy | None = None,
) -> Report:
    """Read every target, attach the model's kinds if given, run the checks, and report.

    An unreadable checkpoint becomes an entry with ``error`` set, unless ``raise_errors``. ``strict``
    raises every finding a loader might read differently to an error (see ``check.strict_findings``).
    ``policy`` adds what only the whole run can tell: its rules that no checkpoint used (``unused-rule``,
    once per run, on the first checkpoint read); its per-checkpoint checks come in ``checks``.
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
        inv = structure.annotate(inv)  # the module types policies and checks see, guessed where --model gives none
        findings = list(inv.findings)
        for check in checks:
            findings.extend(check(inv))
        if strict:
            findings = strict_findings(findings)
        reports.append(CheckpointReport(path=path, format=inv.format, error=None, inventory=inv, findings=tuple(findings)))
    read = [i for i, r in enumerate(reports) if r.inventory is not None]
    if policy is not None and read:
        unused = policy.unused_rules(r.inventory for r in reports if r.inventory is not None)
        reports[read[0]] = replace(reports[read[0]], findings=reports[read[0]].findings + tuple(unused))
    return Report(tuple(reports), fail_on=fail_on, policy=policy_name or (policy.source if policy else None), strict=strict)
