"""Why a planned output fails, one cause per group of findings, and a way through each.

The findings of a refused plan are grouped by rule and cause, as scan's report groups them. Two causes are
from_pretrained's own, for a Hugging Face folder, and get their own words: config.json's dtype loads every tensor
the class does not keep in fp32 in that dtype (a mixed policy's fp32 norms load in half), and the class's
keep-in-fp32 lists load theirs in float32 whatever is written (a policy that wants them in half cannot pass).
Each says what the loader will give, and which command gives something that works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..formats import hfload
from ..inventory import Finding, Inventory
from ..policy import PRESET_DIR, Policy

HALF_PRESETS = {"float16": "fp16", "bfloat16": "bf16"}
"""The preset that holds a whole model in one half dtype."""


@dataclass(frozen=True)
class Cause:
    """Findings of one severity and rule that share a cause, in one message, with the ways through it."""

    severity: str
    rule: str
    message: str
    subjects: tuple[str, ...]
    """The tensors (or files) it is about, as the findings name them."""
    ways: tuple[str, ...] = ()
    """Commands or calls that give an output that works, each a sentence."""


def few(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` names and a count of the rest."""
    if len(names) <= shown + 1:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f" and {len(names) - shown} more"


def policy_ref(policy: Policy) -> str:
    """How ``dtypeaudit.apply`` is told the policy: a preset by its name, a file by its path."""
    path = Path(policy.source)
    return path.stem if path.parent == PRESET_DIR else str(path)


def plan_causes(
    failing: Sequence[Finding],
    output: Inventory,
    written: Mapping[str, str],
    target: str,
    policy: Policy | None,
    passes: Callable[[str | None], bool],
) -> tuple[Cause, ...]:
    """The causes of ``failing`` (the planned output's findings that fail), in order of first appearance.

    ``output``: the planned output's inventory; ``written``: stored name -> the dtype the plan writes it in;
    ``passes(preset)``: whether the same conversion with that preset (None: no policy) would pass."""
    load = hfload.of_folder(output)
    loaded: dict[str, str] = {}
    stored_of: dict[str, str] = {}
    keeper: Callable[[str], str | None] | None = None
    if load is not None:
        loaded = hfload.loaded_dtypes(output.tensors, load)
        stored_of = {load.loaded_name(t.name): t.name for t in output.tensors}
        keeper = hfload.fp32_keeper(load)
    groups: dict[tuple[str, ...], list[Finding]] = {}
    for f in failing:
        stored = stored_of.get(f.tensor or "", f.tensor or "")
        wanted = f.expected or ()
        if keeper is not None and f.rule == "dtype-mismatch" and f.tensor:
            if stored in loaded and written.get(stored) in wanted and f.actual == loaded[stored]:
                groups.setdefault(("loads-as", f.severity, loaded[stored]), []).append(f)
                continue
            label = keeper(stored)
            if label is not None and f.actual == "float32" and "float32" not in wanted:
                groups.setdefault(("class-keeps", f.severity, label), []).append(f)
                continue
        groups.setdefault(("same", f.severity, f.rule, f.message), []).append(f)
    out = []
    cls = (load.model_class if load is not None else None) or "the model class"
    main = load.dtype if load is not None else target
    for key, found in groups.items():
        subjects = tuple(f.tensor or f.file or "" for f in found)
        named = [s for s in subjects if s]
        expected = " or ".join(sorted({e for f in found for e in f.expected or ()})) or "another dtype"
        if key[0] == "loads-as":
            dtype = key[2]
            message = (
                f"from_pretrained(OUT) would load these {len(found)} tensors ({few(named)}) as {dtype}, where the plan "
                f"writes {expected} as the policy expects: config.json's dtype applies to every parameter {cls} does not keep in fp32"
            )
            out.append(Cause(key[1], "dtype-mismatch", message, subjects, _ways(output, cls, target, policy, passes, dtype)))
        elif key[0] == "class-keeps":
            message = (
                f"from_pretrained(OUT) loads these {len(found)} tensors ({few(named)}) in float32 whatever is written: "
                f"{cls}'s {key[2]} keeps them so under {main}, and the policy expects {expected} for them"
            )
            # no run-time way: the policy itself wants in half what the class runs in float32
            out.append(
                Cause(key[1], "dtype-mismatch", message, subjects, _ways(output, cls, target, policy, passes, None, at_run_time=False))
            )
        else:
            out.append(Cause(key[1], key[2], found[0].message, subjects))
    return tuple(out)


def _ways(
    output: Inventory,
    cls: str,
    target: str,
    policy: Policy | None,
    passes: Callable[[str | None], bool],
    half: str | None,
    *,
    at_run_time: bool = True,
) -> tuple[str, ...]:
    """The conversions that pass (checked: ``passes``), then, for a policy the plan met but the loader undoes,
    the policy applied to the loaded model."""
    ways = []
    preset = HALF_PRESETS.get(half or target)
    if preset is not None and passes(preset):
        ways.append(f"--preset {preset} converts the whole model to {half or target}, which from_pretrained loads as written")
    elif passes(None):
        ways.append("without --policy or --preset, convert keeps in float32 what from_pretrained keeps and casts the rest")
    if not at_run_time or policy is None:
        return tuple(ways)
    model = cls if cls.isidentifier() else "AutoModel"
    ways.append(
        f"keep the policy at run time, without converting: model = transformers.{model}.from_pretrained({str(output.path)!r}, "
        f"dtype=torch.float32); dtypeaudit.apply(model, {policy_ref(policy)!r}, to={target!r}) (loaded in float32, every "
        "tensor the policy keeps in fp32 keeps its stored values)"
    )
    return tuple(ways)
