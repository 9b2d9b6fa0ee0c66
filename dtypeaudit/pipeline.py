"""The scan pipeline: expand what the user named into checkpoints, read each, and gather one report."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from . import fleet
from .checks import Check
from .errors import CheckpointError, LimitExceeded, UsageError
from .formats import locate, read_checkpoint, remote
from .formats.locate import AnyPath
from .formats.remote import RemotePath
from .formats.sniff import leave_out_reason
from .inventory import CheckpointReport, Inventory, Report, Severity
from .redact import redact

if TYPE_CHECKING:
    from .policy import Policy


# Factories, hub ids and directories are rare on the hot path (a pre-commit hook scanning one file): their modules
# are imported where a target can be one, so that a file's scan does not pay for them.


def _looks_like_factory(target: str) -> bool:
    if ":" not in target:  # every factory names ``module:attribute``
        return False
    from .formats.factory import looks_like_factory

    return looks_like_factory(target)


def _is_hub_id(target: str) -> bool:
    if "/" not in target or os.path.lexists(target):  # a hub id is ``org/name``, and never a local path
        return False
    from .formats.hub import is_hub_id

    return is_hub_id(target)


def expand(targets: Iterable[str], *, exclude: Sequence[str] = (), left_out: list[tuple[str, str]] | None = None) -> list[str]:
    """Files, checkpoint directories, plain directories (searched for checkpoints) and globs, in order, once each.

    In a walked directory every file is scanned unless no loader would read it or it matches an ``exclude``
    glob; each file left out is appended to ``left_out`` as ``(path, why)``.

    URLs (``s3://``, ``gs://``, ``https://``, ``hf://``, any fsspec protocol) and hub ids (``org/name[@rev]``, where
    no local path of that name exists) are expanded the same way: a prefix or repository that is no checkpoint
    directory is walked, its objects looked at by content.
    """
    out: list[str] = []
    for target in targets:
        if _looks_like_factory(target):
            out.append(target)
            continue
        if locate.is_url(target) or _is_hub_id(target):
            out.extend(_expand_remote(target))
            continue
        matches = sorted(glob.glob(target, recursive=True)) if glob.has_magic(target) else [target]
        if not matches:
            raise UsageError(f"no file matches '{target}'")
        for m in matches:
            out.extend(_expand_one(Path(m), tuple(exclude), left_out))
    unique: dict[str, str] = {}
    for p in out:
        unique.setdefault(os.path.realpath(p) if not locate.is_url(p) and os.path.exists(p) else p, p)
    return list(unique.values())


def _is_checkpoint_dir(path: AnyPath) -> bool:
    from .formats import directory

    return (path / ".metadata").is_file() or directory.is_model_directory(path)


def _expand_one(path: AnyPath, exclude: tuple[str, ...] = (), left_out: list[tuple[str, str]] | None = None) -> list[str]:
    """A file or checkpoint directory as named; a plain directory is walked, and every file in it is looked at
    by content (not by suffix): read, unless no loader would read it or ``exclude`` names it (told to ``left_out``)."""
    if not path.is_dir() or _is_checkpoint_dir(path):
        return [locate.target_string(path)]
    from .formats import directory

    skipped: list[tuple[str, str]] = []
    walked = list(directory.walk_files(path, stop_at=_is_checkpoint_dir, on_skip=lambda p, why: skipped.append((str(p), why))))

    def why_not(p: AnyPath) -> str | None:
        rel = p.relative_to(path).as_posix() if isinstance(p, Path) and isinstance(path, Path) else str(p)
        pattern = directory.excluded_by(rel, exclude)
        if pattern:
            return f"--exclude {pattern}"
        return None if p.is_dir() else leave_out_reason(p)

    reasons = remote.concurrent_map(why_not, walked) if isinstance(path, RemotePath) else [why_not(p) for p in walked]
    found = [locate.target_string(p) for p, why in zip(walked, reasons, strict=True) if why is None]
    skipped += [(locate.target_string(p), why) for p, why in zip(walked, reasons, strict=True) if why is not None]
    if not found:
        shown = "; ".join(f"{p} ({why})" for p, why in skipped[:5])
        raise UsageError(f"no checkpoints found under directory '{path}'" + (f": {shown}" if shown else ""))
    if left_out is not None:
        left_out.extend(skipped)
    return found


_REMOTE_MAGIC = ("*", "[")
"""Glob characters in a URL's path (not ``?``, which starts a query string)."""


def _expand_remote(target: str) -> list[str]:
    """A URL or hub id: a glob matched on the store, a folder that is no checkpoint walked, else the target as named.

    Where the store cannot be asked (a missing object, a server error), the target stays as named: its read then
    fails with one line for it alone, and the others are still reported.
    """
    try:
        if _is_hub_id(target) or target.lower().startswith("hf://"):
            from .formats import hub

            found = hub.locate(target if locate.is_url(target) else f"hf://{target}")
            loc = found.location
            if not loc.is_dir() or _is_checkpoint_dir(loc):
                return [target]
            return _expand_one(loc)
        scheme, _, rest = target.partition("://")
        if any(c in rest for c in _REMOTE_MAGIC) and scheme.lower() not in ("http", "https"):
            fs, pattern = remote.filesystem(target)
            rfs = remote.remote_fs(fs)
            matches = sorted(remote.remote_call(lambda: fs.glob(pattern), redact(target)))
            if not matches:
                raise UsageError(f"nothing matches '{redact(target)}'")
            return [x for m in matches for x in _expand_one(RemotePath(rfs, m))]
        return _expand_one(RemotePath.from_url(target))
    except CheckpointError:
        return [target]


def read_target(target: str, exclude: tuple[str, ...] = ()) -> Inventory:
    """The inventory of one expanded target: a factory, a hub id, a URL or a local path; ``exclude``: globs of
    files a checkpoint directory's safety scan leaves out."""
    if _looks_like_factory(target):
        from .formats import factory

        return factory.inventory(target)
    if _is_hub_id(target):
        try:
            return read_checkpoint(f"hf://{target}", label=target, exclude=exclude)
        except CheckpointError as exc:
            if exc.path in (target, f"hf://{target}") and not isinstance(exc, LimitExceeded):
                exc.path = target
                exc.message = f"no such local path; as a Hugging Face hub id: {exc.message}"
            raise
    return read_checkpoint(target, exclude=exclude)


def scan(
    targets: Sequence[str],
    *,
    checks: Sequence[Check] = (),
    model: str | None = None,
    fail_on: Severity = "error",
    policy_name: str | None = None,
    jobs: int | None = None,
    cluster: str | None = None,
    raise_errors: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    strict: bool = False,
    policy: Policy | None = None,
    exclude: Sequence[str] = (),
) -> Report:
    """Read every target, attach the model's kinds if given, run the checks, and report.

    An unreadable checkpoint becomes an entry with ``error`` set, unless ``raise_errors``. ``strict``
    raises every finding a loader might read differently to an error (see ``checks.strict_findings``).
    ``policy`` adds what only the whole run can tell: its rules that no checkpoint used (``unused-rule``,
    once per run, on the first checkpoint read); its per-checkpoint checks come in ``checks``.
    ``jobs`` and ``cluster`` say where each checkpoint's reading and checking runs (see ``fleet.run``):
    local worker processes, or tasks on a Dask cluster; the report is the same, in input order.
    ``exclude``: globs of files that walks and directory safety scans leave out; what a walk leaves out is
    listed in a ``left-out`` note on the first checkpoint.
    """
    left_out: list[tuple[str, str]] = []
    paths = expand(targets, exclude=exclude, left_out=left_out)
    model_inv = None
    if model:
        from .formats import factory

        model_inv = factory.inventory(model)
    work = fleet.Work(
        read=partial(read_target, exclude=tuple(exclude)), checks=tuple(checks), model=model_inv, strict=strict, raise_errors=raise_errors
    )
    reports = fleet.run(fleet.audit_one, paths, work, jobs=jobs, cluster=cluster, progress=progress, lost=_lost)
    read = [i for i, r in enumerate(reports) if r.inventory is not None]
    if policy is not None and read:
        unused = policy.unused_rules(r.inventory for r in reports if r.inventory is not None)
        reports[read[0]] = replace(reports[read[0]], findings=reports[read[0]].findings + tuple(unused))
    if left_out and reports:
        from .formats import directory

        reports[0] = replace(reports[0], findings=reports[0].findings + (directory.left_out_finding(left_out),))
    return Report(tuple(reports), fail_on=fail_on, policy=policy_name or (policy.source if policy else None), strict=strict)


def _lost(path: str, reason: str) -> CheckpointReport:
    return CheckpointReport(path=path, format=None, error=f"{path}: {reason}", inventory=None)
