"""The one pipeline: expand what the user named into checkpoints, then for each read -> structure -> checks ->
its report (``audit_one``, wherever ``fleet`` runs it), and gather one report. ``prepare`` (the structure step) is
what convert's plans use too."""

from __future__ import annotations

import gc
import glob
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fleet, structure
from .checks import Check, run_checks
from .errors import CheckpointError, DtypeAuditError, LimitExceeded, UsageError
from .formats import Format, locate, read_checkpoint, remote
from .formats.locate import AnyPath, TargetKind, TargetRef
from .formats.remote import RemotePath
from .formats.sniff import leave_out_reason
from .inventory import CheckpointReport, Finding, Inventory, Report, Severity
from .redact import redact

if TYPE_CHECKING:
    from .options import ScanSettings
    from .policy import Policy


# Factories, hub ids and directories are rare on the hot path (a pre-commit hook scanning one file): their modules
# are imported where a target can be one, so that a file's scan does not pay for them.


def expand(targets: Iterable[str], *, exclude: Sequence[str] = (), left_out: list[tuple[str, str]] | None = None) -> list[str]:
    """The names of what ``expand_targets`` finds (see there)."""
    return [t.text for t in expand_targets(targets, exclude=exclude, left_out=left_out)]


def expand_targets(
    targets: Iterable[str | TargetRef], *, exclude: Sequence[str] = (), left_out: list[tuple[str, str]] | None = None
) -> list[TargetRef]:
    """Files, checkpoint directories, plain directories (searched for checkpoints) and globs, in order, once each.

    Each string is parsed once (``locate.parse_target``). In a walked directory every file is scanned unless no
    loader would read it or it matches an ``exclude`` glob; each file left out is appended to ``left_out`` as
    ``(path, why)``. A file a walk finds carries the path the walk found it at.

    URLs (``s3://``, ``gs://``, ``https://``, ``hf://``, any fsspec protocol) and hub ids (``org/name[@rev]``, where
    no local path of that name exists) are expanded the same way: a prefix or repository that is no checkpoint
    directory is walked, its objects looked at by content.
    """
    out: list[TargetRef] = []
    for named in targets:
        target = locate.as_target(named)
        if target.kind is TargetKind.FACTORY:
            out.append(target)
            continue
        if target.is_remote:
            out.extend(_expand_remote(target))
            continue
        if target.file_url and target.where is not None:  # a local path named by URL: no glob, reported as named
            out.extend(_expand_one(target.where, tuple(exclude), left_out, named=target))
            continue
        matches = sorted(glob.glob(target.text, recursive=True)) if glob.has_magic(target.text) else [target.text]
        if not matches:
            raise UsageError(f"no file matches '{target.text}'")
        for m in matches:
            out.extend(_expand_one(Path(m), tuple(exclude), left_out))
    unique: dict[str, TargetRef] = {}
    for t in out:
        unique.setdefault(t.identity, t)  # a local path is one checkpoint under any spelling, file:// too
    return list(unique.values())


def _checkpoint_dir(path: AnyPath) -> Mapping[str, Any] | None:
    """None where the folder ``path`` is no checkpoint; else the JSON documents parsed to tell that it is a model
    (config.json, the index: ``directory.Documents.under``; none for DCP), which its read takes instead of parsing
    them again (``TargetRef.documents``)."""
    if (path / ".metadata").is_file():
        return {}
    from .formats import directory

    docs = directory.Documents()
    return docs.under(path) if directory.is_model_directory(path, docs) else None


def _learned(target: TargetRef, documents: Mapping[str, Any] | None) -> TargetRef:
    """``target`` carrying what telling its folder a model parsed (its read parses none of it again)."""
    return replace(target, documents=documents) if documents else target


def _expand_one(
    path: AnyPath,
    exclude: tuple[str, ...] = (),
    left_out: list[tuple[str, str]] | None = None,
    named: TargetRef | None = None,
    hub_origin: tuple[str, str | None] | None = None,
) -> list[TargetRef]:
    """A file or checkpoint directory as named (``named``, else its path); a plain directory is walked, and every file
    in it is looked at by content (not by suffix): read, unless no loader would read it or ``exclude`` names it (told
    to ``left_out``). ``hub_origin``: what the files of a hub repository read from the hub carry."""
    if not path.is_dir():
        return [named or locate.path_target(path, hub_origin=hub_origin)]
    documents = _checkpoint_dir(path)
    if documents is not None:
        return [_learned(named or locate.path_target(path, hub_origin=hub_origin), documents)]
    from .formats import directory

    skipped: list[tuple[str, str]] = []
    learned: dict[str, Mapping[str, Any]] = {}  # the checkpoint folders the walk stops at: what telling them parsed

    def stop_at(p: AnyPath) -> bool:
        found = _checkpoint_dir(p)
        if found is not None:
            learned[str(p)] = found
        return found is not None

    walked = list(directory.walk_files(path, stop_at=stop_at, on_skip=lambda p, why: skipped.append((str(p), why))))

    def why_not(p: AnyPath) -> str | None:
        rel = p.relative_to(path).as_posix() if isinstance(p, Path) and isinstance(path, Path) else str(p)
        pattern = directory.excluded_by(rel, exclude)
        if pattern:
            return f"--exclude {pattern}"
        return None if p.is_dir() else leave_out_reason(p)

    reasons = remote.concurrent_map(why_not, walked) if isinstance(path, RemotePath) else [why_not(p) for p in walked]
    kept = [p for p, why in zip(walked, reasons, strict=True) if why is None]
    found = [_learned(locate.path_target(p, hub_origin=hub_origin), learned.get(str(p))) for p in kept]
    skipped += [(locate.target_string(p), why) for p, why in zip(walked, reasons, strict=True) if why is not None]
    if not found:
        shown = "; ".join(f"{p} ({why})" for p, why in skipped[:5])
        raise UsageError(f"no checkpoints found under directory '{path}'" + (f": {shown}" if shown else ""))
    if left_out is not None:
        left_out.extend(skipped)
    return found


_REMOTE_MAGIC = ("*", "[")
"""Glob characters in a URL's path (not ``?``, which starts a query string)."""


def _expand_remote(target: TargetRef) -> list[TargetRef]:
    """A URL or hub id: a glob matched on the store, a folder that is no checkpoint walked, else the target as named.

    Where the store cannot be asked (a missing object, a server error), the target stays as named: its read then
    fails with one line for it alone, and the others are still reported. A target that is no folder stays as
    named and keeps where it was found, so that reading it does not locate it again.
    """
    try:
        if target.kind is TargetKind.HUB:
            loc, found = target.located()
            origin = (found.source, found.revision) if found is not None else target.hub_origin
            as_named = replace(target, where=loc, hub_origin=origin)
            # the files of a repository read from the hub still come from the hub; those of a cached one are local files
            return _expand_one(loc, named=as_named, hub_origin=origin if isinstance(loc, RemotePath) else None)
        scheme, _, rest = target.text.partition("://")
        if any(c in rest for c in _REMOTE_MAGIC) and scheme.lower() not in ("http", "https"):
            fs, pattern = remote.filesystem(target.text)
            rfs = remote.remote_fs(fs)
            matches = sorted(remote.remote_call(lambda: fs.glob(pattern), redact(target.text)))
            if not matches:
                raise UsageError(f"nothing matches '{redact(target.text)}'")
            return [x for m in matches for x in _expand_one(RemotePath(rfs, m))]
        loc, _ = target.located()
        return _expand_one(loc)  # named by its path's URL, as a walk names what it finds
    except CheckpointError:
        return [target]


def read_target(target: str | TargetRef, exclude: tuple[str, ...] = ()) -> Inventory:
    """The inventory of one expanded target: a factory, a hub id, a URL or a local path; ``exclude``: globs of
    files a checkpoint directory's safety scan leaves out. A string is parsed first (``locate.parse_target``)."""
    target = locate.as_target(target)
    if target.kind is TargetKind.FACTORY:
        from .formats import factory

        return factory.inventory(target.text)
    return _read_located(target, exclude)  # a model folder's documents the expansion parsed travel in the target


def _read_located(target: TargetRef, exclude: tuple[str, ...]) -> Inventory:
    if target.kind is TargetKind.HUB and not target.named_by_url:  # a bare hub id, where no local path has its name
        try:
            return read_checkpoint(target, label=target.text, exclude=exclude)
        except CheckpointError as exc:
            if exc.path in (target.text, target.hub_url) and not isinstance(exc, LimitExceeded):
                raise exc.naming(target.text, message=f"no such local path; as a Hugging Face hub id: {exc.message}") from exc
            raise
    return read_checkpoint(target, exclude=exclude)


@dataclass(frozen=True)
class Work:
    """What every checkpoint of one scan goes through; sent once to each worker, not with every task."""

    read: Callable[[TargetRef], Inventory]
    """The reader (``read_target``): a target to its inventory."""
    checks: tuple[Check, ...] = ()
    """Per-checkpoint checks; picklable (module-level functions and partials), since they travel to workers."""
    model: Inventory | None = None
    """``--model``'s inventory, built once by the caller, attached to every checkpoint."""
    strict: bool = False
    """Raise every finding a loader might read differently to an error (``checks.strict_findings``)."""
    raise_errors: bool = False
    """Raise a reader's error instead of reporting it (``--debug``)."""


def model_inventory(model: str | None) -> Inventory | None:
    """``--model``'s inventory (a factory, ``transformers:TYPE`` or a folder with config.json), built once, or None."""
    if not model:
        return None
    from .formats import factory

    return factory.inventory(model)


def prepare(inv: Inventory, model: Inventory | None = None) -> Inventory:
    """The structure step of the pipeline: ``--model``'s module types attached (when given), then the structure's
    guesses (``structure.annotate``), so that checks and plans see the module types ``scan`` sees."""
    if model is not None and inv.format != Format.FACTORY:
        from .formats import factory

        inv = factory.attach(inv, model)
    return structure.annotate(inv)


def audit_inventory(
    inv: Inventory, checks: Sequence[Check], *, model: Inventory | None = None, strict: bool = False
) -> tuple[Inventory, list[Finding]]:
    """The pipeline after the read: structure (``prepare``, inferred once) -> checks (``checks.run_checks``).
    Returns the prepared inventory and its findings; a scanned checkpoint (``audit_one``) and a live object
    (``live.auditor``) go through it alike."""
    return run_checks(prepare(inv, model), checks, strict=strict)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: what one checkpoint's read and checks make are records and tuples,
    freed by reference counts, and the collector's passes over a million-tensor header's objects were half the
    time its read took. What cycles there are wait for the next collection after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def audit_one(target: str | TargetRef, work: Work) -> CheckpointReport:
    """The one pipeline, for one checkpoint: read -> structure -> checks (``audit_inventory``) -> its report; the unit
    of a scan, wherever it runs (``fleet.run``). An unreadable checkpoint is a report with ``error`` set, unless
    ``work.raise_errors``."""
    with _collector_paused():
        return _audit_one(target, work)


def _audit_one(target: str | TargetRef, work: Work) -> CheckpointReport:
    ref = locate.as_target(target)
    try:
        inv = work.read(ref)
    except DtypeAuditError as exc:
        if work.raise_errors:
            raise
        return CheckpointReport(path=ref.text, format=None, error=exc.one_line(), inventory=None)
    inv, findings = audit_inventory(inv, work.checks, model=work.model, strict=work.strict)
    return CheckpointReport(path=ref.text, format=inv.format, error=None, inventory=inv, findings=tuple(findings))


def scan(
    targets: Sequence[str | TargetRef],
    *,
    settings: ScanSettings | None = None,
    checks: Sequence[Check] = (),
    model: str | None = None,
    fail_on: Severity | None = None,
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
    listed in a ``left-out`` note on the first checkpoint. ``fail_on``: the severity at or above which the report
    fails; None takes ``policy``'s own ``fail_on``, else ``error`` (``options.fail_on_for``, as the command line).
    ``settings`` (``options.effective``, as the command line resolves them) gives the policy, ``fail_on`` and
    ``strict`` instead, and its checks (the policy's and the target's) come before ``checks``.
    """
    if settings is not None:
        checks = (*settings.checks(), *checks)
        policy, fail_on, strict = settings.policy, settings.fail_on, settings.strict
    left_out: list[tuple[str, str]] = []
    found = expand_targets(targets, exclude=exclude, left_out=left_out)
    model_inv = model_inventory(model)
    reader = partial(read_target, exclude=tuple(exclude))
    work = Work(read=reader, checks=tuple(checks), model=model_inv, strict=strict, raise_errors=raise_errors)
    reports = fleet.run(audit_one, found, work, jobs=jobs, cluster=cluster, progress=progress, lost=_lost)
    read = [i for i, r in enumerate(reports) if r.inventory is not None]
    if policy is not None and read:
        unused = policy.unused_rules(r.inventory for r in reports if r.inventory is not None)
        reports[read[0]] = replace(reports[read[0]], findings=reports[read[0]].findings + tuple(unused))
    if left_out and reports:
        from .formats import directory

        reports[0] = replace(reports[0], findings=reports[0].findings + (directory.left_out_finding(left_out),))
    from .options import fail_on_for

    failing_at = fail_on_for(policy, fail_on)  # as the command line resolves it: the policy's own, else error
    return Report(tuple(reports), fail_on=failing_at, policy=policy_name or (policy.source if policy else None), strict=strict)


def _lost(path: str, reason: str) -> CheckpointReport:
    """The report of a checkpoint whose Dask worker was lost (``fleet.run``'s ``lost``)."""
    return CheckpointReport(path=path, format=None, error=f"{path}: {reason}", inventory=None)
