"""Conversion: plan -> check values (from the bits) -> cast and stream-write to a temporary file -> verify -> atomic rename.

Nothing from the checkpoint is executed. A torch.save archive is re-emitted from its own pickle with
only the storage types changed (see formats/pickleout.py); every other byte of meaning is kept.
Memory stays bounded by a chunk (a tensor, for non-contiguous views into safetensors), never the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..formats import read_checkpoint
from ..inventory import Finding, Inventory
from ..policy import Policy
from ..torchcast import load_torch
from ..values import ValueStats
from .atomic import atomic_output, check_destination, default_output, flushing
from .checks import apply_value_policy, check_values, measure_errors, value_findings
from .plan import CASTABLE, TARGETS, Plan, TensorPlan, make_plan
from .source import Progress, Source, source_files
from .verify import verify
from .write import parse_size, write_directory, write_file


@dataclass
class Result:
    plan: Plan
    """What happens to each tensor; empty when the conversion was ``refused``."""
    output: Path | None
    """What was written, or None (a dry run, unsafe values, a refusal)."""
    unsafe: list[ValueStats]
    """Tensors whose values block the conversion; nothing was written."""
    dry_run: bool = False
    refused: tuple[Finding, ...] = ()
    """The reader's findings that forbid converting this checkpoint at all (see ``refusals``); nothing was written."""

    @property
    def blocked(self) -> bool:
        """Nothing was written because of the checkpoint itself or its values: the command fails (exit 1)."""
        return bool(self.refused or self.unsafe)


# A rewrite would carry what hides after the pickle along or silently drop it: either way it launders it.
REFUSED_WARNINGS = frozenset({"trailing-data"})


def refusals(inv: Inventory) -> tuple[Finding, ...]:
    """The reader's findings that make ``convert`` refuse before anything is written.

    Every error the reader raises (a code-running global, a pickled whole module, an index that
    disagrees with its shards) and trailing data.
    """
    return tuple(f for f in inv.findings if f.severity == "error" or f.rule in REFUSED_WARNINGS)


def pickled_module_files(findings: Iterable[Finding]) -> list[str | None]:
    """The files (None: the checkpoint itself) that the reader found to pickle a whole nn.Module."""
    out: list[str | None] = []
    for f in findings:
        if f.rule == "pickled-module" and f.file not in out:
            out.append(f.file)
    return out


def output_format(source_format: str, dest: Path, source: Path) -> str:
    if source.is_dir():
        return "hf-directory"
    if dest.suffix == ".safetensors":
        return "safetensors"
    if source_format == "safetensors":
        raise UsageError("safetensors input converts to safetensors output; give -o NAME.safetensors")
    return "torch-zip"


def convert(
    source: str | Path,
    to: str,
    *,
    output: str | Path | None = None,
    policy: Policy | None = None,
    keep: tuple[str, ...] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
    keep_unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    in_place: bool = False,
    progress_factory: Callable[[str, int], Progress] | None = None,
    max_shard_size: str | None = None,
) -> Result:
    """Plan, check values, write atomically and verify.

    A checkpoint ``scan`` flags as an error is refused before anything is written (see ``Result.refused``);
    unsafe values block too (see ``Result.unsafe``). Neither raises: the Result says why.
    """
    src_path = Path(source)
    inv = read_checkpoint(src_path)
    if include_optimizer and strip_optimizer:
        raise UsageError("--include-optimizer and --strip-optimizer contradict each other")
    refused = refusals(inv)
    if refused:
        # make_plan owns what --to means; an empty inventory asks it only that.
        target = make_plan(Inventory(inv.path, "torch-zip", ()), to).target
        return Result(Plan(inv, target, []), None, [], dry_run=dry_run, refused=refused)
    plan = make_plan(inv, to, policy=policy, keep=keep, include_optimizer=include_optimizer, strip_optimizer=strip_optimizer, clamp=clamp)
    dest = src_path if in_place else Path(output) if output else default_output(src_path, plan.target)
    out_format = output_format(inv.format, dest, src_path)
    if out_format == "safetensors" and not output and not in_place:
        dest = default_output(src_path, plan.target, "safetensors")
    if max_shard_size and out_format != "hf-directory":
        raise UsageError("--max-shard-size applies to Hugging Face directories")
    if strip_optimizer and out_format != "torch-zip":
        plan.notes.append("safetensors output holds no optimizer state anyway")
    with ExitStack() as stack:
        files = source_files(src_path, inv)
        sources = {label: Source(path, sub, stack) for label, (path, sub) in files.items()}
        check_progress = (lambda total: progress_factory("checking values", total)) if progress_factory else None
        check_values(plan, sources, check_progress, meanwhile=load_torch if plan.counts().get("cast") else None)
        unsafe = apply_value_policy(plan, keep_unsafe=keep_unsafe)
        if dry_run and not unsafe:
            measure_errors(plan, sources)
        if dry_run or unsafe:
            return Result(plan, None, unsafe, dry_run=dry_run)
        check_destination(src_path, dest, force=force, in_place=in_place)
        total = sum(p.tensor.nbytes for p in plan.tensors if p.action != "drop")
        progress = progress_factory("writing", total) if progress_factory else None
        if out_format == "hf-directory":
            with atomic_output(dest, mode_from=src_path, is_dir=True) as tmp:
                write_directory(
                    plan,
                    src_path,
                    sources,
                    tmp,
                    strip_optimizer=strip_optimizer,
                    progress=progress,
                    max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
                )
        else:
            ((label, src),) = sources.items()
            with atomic_output(dest, mode_from=src_path) as tmp:
                written = write_file(plan, src, tmp, out_format, strip_optimizer=strip_optimizer, progress=progress)
                with flushing(tmp):
                    verify(plan, tmp, written)
    return Result(plan, dest, [])


__all__ = [
    "CASTABLE",
    "TARGETS",
    "Plan",
    "Result",
    "TensorPlan",
    "check_values",
    "convert",
    "make_plan",
    "pickled_module_files",
    "refusals",
    "value_findings",
]
