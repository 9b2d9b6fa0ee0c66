"""Conversion: plan (once: ``make_plan``, or ``dequantize.make_dequant_plan`` for a quantized source) -> lay the
output out -> check values, cast and write each piece in one pass (pieces.py) -> verify -> atomic rename.

Nothing from the checkpoint is executed. A torch.save archive keeps its own pickle's bytes with only the storage
types edited where the reader found them (see formats/picklesplice.py); every other byte of meaning is kept.
Memory stays bounded by a chunk (a tensor, for non-contiguous views into safetensors), never the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import DtypeAuditError, UsageError
from ..formats import Format, read_checkpoint
from ..formats.locate import TargetRef, as_target, parse_target
from ..inventory import Inventory, format_of
from ..options import ConvertSettings, convert_settings
from ..pieces import Workers
from ..pipeline import model_inventory, prepare
from ..torchcast import load_torch, one_thread
from ..values import measures_errors
from .atomic import atomic_output, check_destination, default_output, flushing
from .mapped import MappedCheckpoint, Progress, open_sources
from .plan import Plan, TensorPlan, make_plan, unit_of, with_findings
from .result import Result, pickled_module_files, refusals
from .training import folder_notes
from .value_policy import (
    ValueChecks,
    apply_value_policy,
    blocking_values,
    check_values,
    measure_errors,
    units_to_cast,
    value_findings,
    workers_for,
)
from .verify import Written, verify_written
from .write import (
    casts_need_torch,
    require_torch,
    strip_keys,
    strip_notes,
    torch_needed_for,
    write_directory,
    write_file,
)


def output_format(source_format: str, dest: Path, source: Path) -> Format:
    if source.is_dir():
        return Format.HF_DIRECTORY
    if dest.suffix == ".safetensors":
        return Format.SAFETENSORS
    if source_format == Format.SAFETENSORS:
        raise UsageError("safetensors input converts to safetensors output; give -o NAME.safetensors")
    return Format.TORCH_ZIP


def convert(
    source: str | Path | TargetRef,
    to: str | None = None,
    *,
    settings: ConvertSettings | None = None,
    output: str | Path | None = None,
    progress_factory: Callable[[str, int], Progress] | None = None,
    planned: Plan | None = None,
    **options: Any,
) -> Result:
    """Plan, check the planned output, check values, write atomically and verify.

    ``settings`` (``options.convert_settings``, as the command line makes them), or ``to`` and that function's
    keyword arguments (``policy``, ``keep``, ``clamp``, ``dry_run`` ...), resolved and checked here before the
    source is opened.

    A checkpoint ``scan`` flags as an error is refused before anything is written (see ``Result.refused``);
    so is a plan whose output would fail the policy or a built-in check (``Result.failed``: ``scan`` of
    the output with the same policy must pass), and unsafe values (``Result.unsafe``). None of these
    raises: the Result says why. A format convert cannot convert at all (TorchScript, a bare pickle, DCP)
    is bad input, not a verdict on the checkpoint: it raises ``ConversionError`` (see ``refusals``), before
    anything is written or, for a remote source, downloaded. ``model`` (a factory, as ``scan --model``) gives tensors their module types.
    ``materialize_ties``: a safetensors output holds a copy of a tied tensor under each of its names, so that a
    plain ``load_file`` gives every key back (by default it is written once, the tie kept as a metadata alias).
    ``read_values=False`` makes a dry run metadata-only: the plan, its sizes and refusals from the headers alone,
    at the speed of a scan (the CLI's ``--dry-run``; ``--dry-run --check-values`` reads them). A conversion
    that writes always reads them. ``planned``: the part of a plan made of a
    whole that this one file belongs to (a remote folder's weight file, see remote.py), its tensors relabelled
    as this file's; used as it is, not made again (the whole's output was checked when it was made).
    ``exclude``: globs of a folder's files to leave out, as ``scan --exclude``: not read, and not written to the output.
    """
    if settings is None:
        if to is None:
            raise TypeError("convert() needs the target dtype (to=) or settings=")
        settings = convert_settings(to, output=output, **options)
    elif to is not None or options:
        raise TypeError("convert() takes settings= or to= with its options, not both")
    s = settings
    # Parsed once: a URL or a local path (convert takes no factory or bare hub id: there ``org/name`` is a path).
    named = as_target(source, models=False)
    if named.is_remote:
        from .remote_sources import convert_remote

        if s.exclude:
            raise UsageError("--exclude applies to a local folder; download the folder, then convert it")
        return convert_remote(named, s, convert, output=output, progress_factory=progress_factory)
    if isinstance(output, str) and parse_target(output, models=False).is_remote:
        from ..redact import redact

        raise UsageError(f"{redact(output)}: a remote output needs a remote source; write it locally and upload it")
    src_path = named.where if isinstance(named.where, Path) else Path(named.text)
    if s.max_shard_size and not src_path.is_dir():  # known before the source is opened
        raise UsageError("--max-shard-size applies to Hugging Face directories")
    inv = read_checkpoint(named, exclude=s.exclude)
    refused = refusals(inv)
    if refused:
        return Result(Plan(inv, s.to, []), None, [], dry_run=s.dry_run, refused=refused)
    from ..quant.group import view as quant_view

    quant = quant_view(inv)
    # No writer of ours writes GGUF: an all-float one goes the dequantizing way too, tensor by tensor to safetensors.
    if (quant or ((fmt := format_of(inv.format)) is not None and fmt.dequantizes)) and not s.keep_quantized:
        from .dequantize import convert_quantized

        if s.keep or s.include_optimizer or s.strip_optimizer or s.keep_unsafe or s.max_shard_size or s.model:
            raise UsageError(
                "dequantizing takes no --keep, --include-optimizer, --strip-optimizer, --keep-unsafe, "
                "--max-shard-size or --model; convert the dequantized output again for those"
            )
        return convert_quantized(src_path, inv, quant, s, output=output, progress_factory=progress_factory)
    parts_of = inv  # the reader's own inventory, whose layout (and a directory's parts) conversion reads from
    inv = prepare(inv, model_inventory(s.model))  # the module types the policy sees, as scan sees them
    with ExitStack() as stack:
        sources = open_sources(src_path, parts_of, stack)
        # the optimizer's entries --strip-optimizer removes are known once the sources are open: planned once, with them
        stripped = {label: keys for label, src in sources.items() if (keys := strip_keys(src))} if s.strip_optimizer else {}
        plan_options: dict[str, Any] = {
            "policy": s.policy,
            "keep": s.keep,
            "include_optimizer": s.include_optimizer,
            "strip_optimizer": s.strip_optimizer,
            "clamp": s.clamp,
            "quantized": quant.consumed,
            "stripped": stripped,
        }
        if planned is not None and not stripped:
            plan = replace(planned, source=inv)
        else:  # a folder's weight file that holds optimizer state to strip: what is dropped is known only here
            plan = make_plan(inv, s.to, **plan_options)
        dest = src_path if s.in_place else Path(output) if output else default_output(src_path, plan.target)
        out_format = output_format(inv.format, dest, src_path)
        if out_format == Format.SAFETENSORS and not output and not s.in_place:
            dest = default_output(src_path, plan.target, Format.SAFETENSORS)
        if s.materialize_ties and out_format != Format.SAFETENSORS:
            raise UsageError("--materialize-ties applies to a .safetensors output (a torch.save output keeps ties as ties)")
        if s.strip_optimizer:
            notes = strip_notes(stripped, sources)
            if out_format != Format.TORCH_ZIP:
                notes.append("safetensors output holds no optimizer state anyway")
            plan = replace(plan, notes=[*plan.notes, *notes])
        if out_format == Format.HF_DIRECTORY:  # the training state carried unchanged, what --exclude left out
            plan = replace(plan, notes=[*plan.notes, *folder_notes(parts_of, src_path, set(sources))])
        # The planned output must pass what scan would check, before a byte is read.
        plan = with_findings(plan, s.policy, strict=s.strict) if planned is None or stripped else plan
        if plan.failing(s.policy):
            return Result(plan, None, [], dry_run=s.dry_run, failed=tuple(plan.failing(s.policy)))
        if s.dry_run and not s.read_values:  # metadata only: no value is read, torch is not even imported
            return Result(plan, None, [], dry_run=True, values_read=False)
        check_progress = (lambda total: progress_factory("checking values", total)) if progress_factory else None
        casts = units_to_cast(plan, sources).values()
        needed = torch_needed_for(plan, sources)
        if needed is not None and not s.dry_run:
            require_torch(needed)  # the light install converts what numpy casts; this, before anything is read
        plan = replace(plan, casts_with_torch=needed is not None)

        records: dict[str, Written] = {}

        def written(plan: Plan, workers: Workers | None = None) -> AbstractContextManager[None]:
            return _written_and_verified(
                plan,
                src_path,
                sources,
                dest,
                out_format,
                records,
                force=s.force,
                in_place=s.in_place,
                progress_factory=progress_factory,
                max_shard_size=s.max_shard_size,
                materialize_ties=s.materialize_ties,
                workers=workers,
            )

        if not s.dry_run and not plan.casts_with_torch:
            # numpy makes every byte: the output is written (and verified) while the value checks run in
            # their child, on the other core, and renamed into place only if they block nothing
            plan, kept = _written_while_checking(plan, sources, check_progress, written)
            if kept:
                return Result(plan, dest, [], written=records)
        else:
            # torch's import overlaps the checks when a cast will need it: before a write, and on a dry run
            # only for the casts whose errors numpy cannot measure from the bits (float64's)
            float64 = any(not measures_errors(dtype, target) for _, dtype, _, _, target in casts)
            torch_next = bool(casts) and (float64 if s.dry_run else plan.casts_with_torch)
            if torch_next and s.dry_run:
                require_torch("only torch's cast measures the errors of a float64 cast")
            plan = replace(plan, values=check_values(plan, sources, check_progress, meanwhile=load_torch if torch_next else None))
        plan, unsafe = apply_value_policy(plan, keep_unsafe=s.keep_unsafe)
        if s.keep_unsafe:
            plan = _hold_unsafe(plan, inv, s.to, plan_options, sources)
            plan = with_findings(replace(plan, casts_with_torch=casts_need_torch(plan, sources)), s.policy, strict=s.strict)
            if plan.failing(s.policy):
                return Result(plan, None, [], dry_run=s.dry_run, failed=tuple(plan.failing(s.policy)))
        if s.dry_run and not unsafe:
            measure_errors(plan, sources)
        if s.dry_run or unsafe:
            return Result(plan, None, unsafe, dry_run=s.dry_run)
        if plan.casts_with_torch:
            stack.enter_context(one_thread())  # torch's casts (see one_thread)
        with written(plan):
            pass
    return Result(plan, dest, [], written=records)


class _Abandoned(Exception):
    """Thrown into a speculative output whose values turned out to block it: the temporary is removed."""


def _written_while_checking(
    plan: Plan,
    sources: dict[str, MappedCheckpoint],
    check_progress: Callable[[int], Progress] | None,
    written: Callable[[Plan, Workers], AbstractContextManager[None]],
) -> tuple[Plan, bool]:
    """Write and verify the output, folding the value checks from the chunks the writer casts (``ValueChecks``);
    returns the plan with its values, and whether the output was renamed into place.

    Both cores make the bytes (``pieces.Workers``); units no record covers whole are checked after. Not renamed
    when the values block (or, with --keep-unsafe, change) the plan: the written temporary is removed and the
    caller goes on as after any value check. An error of the write (an existing output, non-tensor content for
    safetensors) is raised only once the values are known not to block, so that the values' verdict comes
    first, as when the write follows the checks.
    """
    pending = ExitStack()
    deferred: list[DtypeAuditError] = []
    notes = list(plan.notes)  # a writer's notes (ties kept as aliases) belong to an output that is kept
    checks = ValueChecks(plan, sources)
    plan = replace(plan, values=checks.results)  # the writer folds each cast's errors into these
    try:
        with workers_for(plan, sources, checks) as workers:
            try:
                pending.enter_context(written(plan, workers))
            except DtypeAuditError as exc:
                deferred.append(exc)
            rest = checks.remaining()  # a record written in parts (a view), or a write refused before its records
            total = sum(job.length for job in rest)
            workers.run(rest, progress=check_progress(total) if check_progress and total else None)
    except BaseException as exc:
        pending.__exit__(type(exc), exc, exc.__traceback__)
        raise
    plan = replace(plan, values=checks.outcome())
    if blocking_values(plan.values, clamp=plan.clamp):
        pending.__exit__(_Abandoned, _Abandoned(), None)
        for src in sources.values():
            src.forget_rewrite()
        return replace(plan, notes=notes), False
    if deferred:
        raise deferred[0]
    pending.close()  # fsync and rename into place
    return plan, True


@contextmanager
def _written_and_verified(
    plan: Plan,
    src_path: Path,
    sources: dict[str, MappedCheckpoint],
    dest: Path,
    out_format: Format,
    records: dict[str, Written],
    *,
    force: bool,
    in_place: bool,
    progress_factory: Callable[[str, int], Progress] | None,
    max_shard_size: int | None,
    materialize_ties: bool,
    workers: Workers | None = None,
) -> Iterator[None]:
    """Write ``plan``'s output to a temporary beside ``dest`` and verify it, each file's ``Written`` left in
    ``records`` (see ``Result.written``); on leaving, fsync and rename it into place."""
    check_destination(src_path, dest, force=force, in_place=in_place)
    records.clear()  # a speculative write abandoned before this one left its files' records
    total = sum(p.tensor.nbytes for p in plan.tensors if p.action != "drop")
    progress = progress_factory("writing", total) if progress_factory else None

    def unchanged() -> None:
        for src in sources.values():
            src.check_unchanged()

    if out_format == Format.HF_DIRECTORY:
        with atomic_output(dest, mode_from=src_path, is_dir=True, sources_unchanged=unchanged) as tmp:
            records.update(
                write_directory(
                    plan,
                    src_path,
                    sources,
                    tmp,
                    progress=progress,
                    max_shard_size=max_shard_size,
                    workers=workers,
                )
            )
            yield
    else:
        ((label, src),) = sources.items()
        with atomic_output(dest, mode_from=src_path, sources_unchanged=unchanged) as tmp:
            record = write_file(
                plan,
                src,
                tmp,
                out_format,
                strip=plan.stripped.get(label, ()),
                progress=progress,
                materialize_ties=materialize_ties,
                workers=workers,
            )
            with flushing(tmp):
                verify_written(tmp, record)
            records[dest.name] = record
            yield


def _hold_unsafe(plan: Plan, inv: Inventory, to: str, options: dict[str, Any], sources: dict[str, MappedCheckpoint]) -> Plan:
    """Plan again with the units --keep-unsafe kept held, so that their modules and ties stay with them.

    A module partner kept with them needs no value check; one newly cast (a float16 bias joining its
    float32 weight) is checked before it joins, and kept in turn if its values are unsafe too. Each round
    holds more units, so this ends; a partner newly cast is a rare narrowing (float64 to a held float32).
    """
    held: set[str] = set()
    notes = list(plan.notes)
    values = dict(plan.values)
    while True:
        newly = {unit_of(p.tensor) for p in plan.tensors if p.action == "keep" and p.reason.endswith("(--keep-unsafe)")} - held
        if not newly:
            return plan
        held |= newly
        plan = make_plan(inv, to, hold=held, **options)
        cast_units = {unit_of(p.tensor) for p in plan.tensors if p.action == "cast"}
        fresh = [p for p in plan.tensors if p.action == "cast" and unit_of(p.tensor) not in values]
        if fresh:
            values.update(check_values(Plan(inv, plan.target, fresh, clamp=plan.clamp), sources))
        plan = replace(plan, notes=list(dict.fromkeys([*notes, *plan.notes])), values={u: s for u, s in values.items() if u in cast_units})
        plan, _ = apply_value_policy(plan, keep_unsafe=True)
        notes = plan.notes


@dataclass(frozen=True)
class ConvertWork:
    """What every source of one ``convert SOURCE...`` goes through (``fleet.run`` sends it once to each worker)."""

    settings: ConvertSettings
    """What every source's conversion does (resolved once, by the caller)."""
    outputs: Mapping[str, str] = field(default_factory=dict)
    """Source (by its ``TargetRef.identity``, which survives the trip to a remote worker, where a relative path is
    sent whole) -> where its output goes (an absolute path), where ``-o`` names a directory or the one source's
    output; a source not here is written beside itself."""
    raise_errors: bool = False
    """Raise a source's error instead of reporting it (``--debug``)."""


@dataclass(frozen=True)
class Converted:
    """One source's conversion as its task returns it."""

    source: str
    """The source as named."""
    result: Any = None
    """The ``Result``; None when ``error`` says why there is none."""
    error: str | None = None
    """None, or the one line why the source could not be converted (exit 2 for it)."""


def convert_one(source: TargetRef, work: ConvertWork) -> Converted:
    """Convert one source, parsed once (plan, check, write, verify): the unit of ``convert SOURCE...``, wherever
    ``fleet`` runs it."""
    try:
        return Converted(source.text, convert(source, settings=work.settings, output=work.outputs.get(source.identity)))
    except DtypeAuditError as exc:
        if work.raise_errors:
            raise
        return Converted(source.text, error=exc.one_line())


def convert_lost(source: str, reason: str) -> Converted:
    """The outcome of a source whose Dask worker was lost (``fleet.run``'s ``lost``)."""
    return Converted(source, error=f"{source}: {reason}")


__all__ = [
    "ConvertWork",
    "Converted",
    "Plan",
    "Result",
    "TensorPlan",
    "check_values",
    "convert",
    "convert_lost",
    "convert_one",
    "make_plan",
    "pickled_module_files",
    "refusals",
    "value_findings",
    "with_findings",
]
