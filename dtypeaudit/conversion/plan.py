"""The conversion plan: what happens to each tensor, decided before any byte is read.

A plan keeps modules whole and ties together: the floating tensors directly under one dotted prefix
(``fc.weight`` and ``fc.bias``; a BatchNorm's weight, bias and running statistics) and the names of one
storage take one dtype, because PyTorch's kernels refuse a Linear whose weight and bias differ and a
BatchNorm whose statistics differ from its weight. Where the policy allows a dtype every member accepts,
the plan picks it; where it cannot, the planned output fails its checks and ``convert`` refuses (see
``with_findings``).

A ``Plan`` is made once, complete, by ``make_plan`` (a cast source) or ``dequantize.make_dequant_plan`` (a
quantized one); a later step that knows more (the values read, the findings of the planned output) derives a new
one with ``dataclasses.replace``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from .. import dtypes
from ..errors import ConversionError, DtypeAuditError, UsageError
from ..formats.hfload import fp32_keeper, loaded_names, of_folder
from ..formats.training import is_training_state
from ..inventory import Finding, Format, Inventory, TensorRecord, failing, floating_bytes, format_of, unique_tensors
from ..options import effective, fail_on_for
from ..policy import Matcher, Policy, compile_matcher, decide
from ..structure import annotate
from ..values import ValueStats
from .causes import Cause, plan_causes

QUANTIZED_KEPT = "quantized storage kept byte for byte (--keep-quantized)"
KEPT_FP32 = "kept in float32: "
"""How the reason of a tensor the model class keeps in float32 begins (``loader_keeps``)."""
# Where a policy allows several dtypes and not the target: the widest half-precision-safe one first.
PREFERENCE = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor."""

    tensor: TensorRecord
    target: str
    """The dtype it will have (its own when left or kept)."""
    action: str
    """``cast``, ``keep`` (a rule or --keep holds it), ``leave`` (not convertible or already there), ``drop``,
    ``dequantize`` (a quantized logical weight written in the target dtype, see quant/convert.py)."""
    reason: str = ""

    def nbytes_as(self, dtype: str) -> int:
        """The tensor's bytes in ``dtype`` (exotic layouts keep their size)."""
        t = self.tensor
        return t.numel * dtypes.get(dtype).itemsize if t.layout == "strided" else t.nbytes

    @property
    def out_nbytes(self) -> int:
        return 0 if self.action == "drop" else self.nbytes_as(self.target)


@dataclass(frozen=True)
class Plan:
    source: Inventory
    target: str
    tensors: list[TensorPlan]
    """What happens to each tensor (a cast, a dequantize, a copy as it is (``keep``/``leave``) or a ``drop``)."""
    clamp: bool = False
    values: dict[str, ValueStats] = field(default_factory=dict)
    """What each cast does to its unit's values: float16 range checks (NaN/Inf, overflow, underflow,
    subnormals) and the cast's max absolute and relative error, by unit, for every unit cast."""
    notes: list[str] = field(default_factory=list)
    """What the user should know of the output; a writer adds what only it finds (ties kept as aliases)."""
    config_dtype: str | None = None
    """The dtype from_pretrained should load the output in (Hugging Face directories), which its config.json will
    name where it has one (``config_json_dtype``)."""
    findings: list[Finding] = field(default_factory=list)
    """What ``scan`` with the same policy would report on the planned output (see ``with_findings``)."""
    stripped: dict[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    """File label -> the mapping entries (key paths) ``--strip-optimizer`` removes from that file's object."""
    casts_with_torch: bool = False
    """torch makes every cast (``write.casts_need_torch``: some cast needs it); otherwise numpy does wherever it can."""
    causes: tuple[Cause, ...] = ()
    """Why the planned output fails (``failing``), one cause per group of findings, each with its ways through."""

    def _unique(self) -> list[TensorPlan]:
        """One plan per tensor, however many names it has (tied weights count once)."""
        first = {id(t) for t in unique_tensors(p.tensor for p in self.tensors)}
        return [p for p in self.tensors if id(p.tensor) in first]

    @property
    def bytes_before(self) -> int:
        # A dequantized weight had no bytes of its own: its quantized storage (dropped) held them.
        return sum(p.nbytes_as(p.tensor.dtype) for p in self._unique() if p.action != "dequantize")

    @property
    def bytes_after(self) -> int:
        return sum(p.out_nbytes for p in self._unique())

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.tensors:
            out[p.action] = out.get(p.action, 0) + 1
        return out

    def output_inventory(self, config_dtype: str | None = None) -> Inventory:
        """The inventory the output will have, as a reader would report it: planned dtypes, dropped tensors gone."""
        dropped = {p.tensor.name for p in self.tensors if p.action == "drop"}
        tensors = []
        for p in self.tensors:
            if p.action == "drop":
                continue
            t = p.tensor
            shares = tuple(n for n in t.shares_with if n not in dropped)
            tensors.append(t.with_(dtype=p.target, nbytes=p.out_nbytes, shares_with=shares))
        metadata = dict(self.source.metadata)
        if any(p.action == "dequantize" for p in self.tensors):  # the loader no longer quantizes what is dequantized
            metadata.pop("quantization_config", None)
        chosen = config_dtype if config_dtype is not None else self.config_dtype
        if chosen is not None:
            metadata["config_dtype"] = chosen
        return replace(self.source, tensors=tuple(tensors), findings=(), metadata=metadata)

    @property
    def config_json_dtype(self) -> str | None:
        """The dtype the output's config.json names: ``config_dtype``, or None where the folder has no config.json
        (an index alone), nothing then naming one."""
        load = of_folder(self.source)
        return None if load is not None and not load.config_json else self.config_dtype

    def failing(self, policy: Policy | None) -> list[Finding]:
        """The planned output's findings that would fail ``scan`` with ``policy`` (at its fail_on, else error)."""
        return failing(self.findings, fail_on_for(policy))


def unit_of(t: TensorRecord) -> str:
    """The unit of conversion: a storage in torch archives (views and ties convert together), else the tensor."""
    return f"{t.file}\0{t.storage}" if t.storage is not None else f"{t.file}\0{t.name}"


@dataclass
class _Choice:
    """One floating tensor's own answer, before its module and its ties are considered."""

    index: int
    tensor: TensorRecord
    allowed: frozenset[str]
    """The dtypes it may take: what the policy accepts, or only its own where something holds it."""
    want: str
    action: str
    reason: str
    held: bool
    """--keep, --keep-unsafe or optimizer state left alone: its dtype is fixed."""


def make_plan(
    inv: Inventory,
    to: str,
    *,
    policy: Policy | None = None,
    keep: tuple[str, ...] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
    hold: Iterable[str] = (),
    stripped: dict[str, tuple[tuple[str, ...], ...]] | None = None,
    quantized: frozenset[str] = frozenset(),
) -> Plan:
    """Decide every tensor: first on its own (--keep, the policy, the target), then with its module and ties.

    ``hold``: units (see ``unit_of``) kept as they are because of their values (--keep-unsafe).
    ``stripped``: file label -> the entries (key paths) --strip-optimizer removes; tensors under them are dropped.
    ``quantized``: storage tensors of quantized weights that --keep-quantized keeps byte for byte; they take no
    part in module or tie decisions (a float32 scale does not pull its Linear's bias to float32).
    """
    target = dtypes.conversion_target(to)
    # The same refusal for --dry-run and the real run: a format our writers cannot write again is refused here,
    # before a plan is shown (a GGUF reaches this only with --keep-quantized; otherwise it is dequantized).
    refusal = (fmt := format_of(inv.format)) and fmt.cast_refusal
    if refusal:
        raise ConversionError(refusal, path=inv.path)
    inv = annotate(inv)  # a no-op after convert's own; policies' module: rules see the guessed types
    keepers: list[Matcher] = []
    for pattern in keep:
        try:
            keepers.append(compile_matcher(pattern))
        except ValueError as exc:
            raise UsageError(f"--keep {pattern!r}: {exc}") from None
    held_units = frozenset(hold)
    stripped = stripped or {}
    renamed = loaded_names(inv)  # a folder's policy is decided on the names from_pretrained gives, as scan decides it
    loader_kept = loader_keeps(inv, target)

    def dropped_by(t: TensorRecord) -> str | None:
        for path in stripped.get(t.file, ()):
            key = ".".join(path)
            if t.name == key or t.name.startswith(key + "."):
                return key
        return None

    plans: list[TensorPlan] = []
    choices: list[_Choice] = []
    for i, t in enumerate(inv.tensors):
        key = dropped_by(t) if strip_optimizer else None
        if key is not None:
            what = "optimizer state" if t.region == "optimizer" else "training state"
            plans.append(TensorPlan(t, t.dtype, "drop", f"{what} stripped (--strip-optimizer)"))
            continue
        if t.name in quantized:
            plans.append(TensorPlan(t, t.dtype, "keep", QUANTIZED_KEPT))
            continue
        if strip_optimizer and t.region == "optimizer":
            plans.append(TensorPlan(t, t.dtype, "leave", "optimizer state inside a list or an object: --strip-optimizer cannot remove it"))
            continue
        if is_training_state(t):  # a ModelCheckpoint's kth_value is the callback's, not the model's: never cast with it
            plans.append(TensorPlan(t, t.dtype, "leave", "training state (callbacks, loops, schedulers) is left as stored"))
            continue
        if t.dtype not in dtypes.CASTABLE or t.layout != "strided":
            what = t.layout if t.layout != "strided" else t.dtype
            plans.append(TensorPlan(t, t.dtype, "leave", f"{what} tensors are left exactly as they are"))
            continue
        c = _choose(i, t, target, policy, keepers, include_optimizer, held_units, renamed.get(t.name, t.name), loader_kept(t.name))
        choices.append(c)
        plans.append(TensorPlan(t, c.want, c.action, c.reason))
    notes = _keep_whole(plans, choices, target)
    return Plan(inv, target, plans, clamp=clamp, notes=notes, stripped=dict(stripped))


def loader_keeps(inv: Inventory, target: str) -> Callable[[str], str | None]:
    """stored name -> why from_pretrained loads it in float32 once config.json's dtype is ``target`` (the class's
    ``_keep_in_fp32_modules``, ``_keep_in_fp32_modules_strict``, from the table: ``hfload``); None where it does not
    (every tensor but a Hugging Face folder's)."""
    load = of_folder(inv)
    if load is None:
        return lambda name: None
    load = replace(load, dtype=target)
    which = fp32_keeper(load)
    owner = load.model_class or "the model class"

    def why(name: str) -> str | None:
        label = which(name)
        return None if label is None else f"{KEPT_FP32}{owner}'s {label} (from_pretrained loads it in float32)"

    return why


def _choose(
    i: int,
    t: TensorRecord,
    target: str,
    policy: Policy | None,
    keepers: list[Matcher],
    include_optimizer: bool,
    held_units: frozenset[str],
    loaded_name: str,
    loader_kept: str | None,
) -> _Choice:
    own = frozenset({t.dtype})
    judged = t.with_(name=loaded_name) if loaded_name != t.name else t
    if t.region == "optimizer" and not include_optimizer:
        return _Choice(i, t, own, t.dtype, "leave", "optimizer state is left as is (--include-optimizer to cast it)", True)
    for m in keepers:
        if m(t.name):
            return _Choice(i, t, own, t.dtype, "keep", f"--keep {m.text}", True)
    if unit_of(t) in held_units:
        return _Choice(i, t, own, t.dtype, "keep", "unsafe values kept at full precision (--keep-unsafe)", True)
    if loader_kept is not None:
        # from_pretrained(output) loads it in float32 whatever is written: written in float32, it holds the
        # values from_pretrained(source, dtype=target) gives it, not their half-precision rounding
        return _Choice(i, t, frozenset({"float32"}), "float32", "keep" if t.dtype == "float32" else "cast", loader_kept, True)
    if policy is None:
        allowed = dtypes.CASTABLE
    else:
        allowed = frozenset(d for d in dtypes.CASTABLE if decide(policy, judged.with_(dtype=d)).ok)
    if target in allowed:
        return _Choice(
            i, t, allowed, target, "leave" if t.dtype == target else "cast", f"already {target}" if t.dtype == target else "", False
        )
    assert policy is not None
    d = decide(policy, judged.with_(dtype=target))
    why = f"policy: {d.rule.label if d.rule else 'default'} expects {_names(d.expected)}"
    if t.dtype in allowed:
        return _Choice(i, t, allowed, t.dtype, "keep", why, False)
    ranked = [x for x in PREFERENCE if x in allowed]
    if ranked:
        return _Choice(i, t, allowed, ranked[0], "cast", why, False)
    # Nothing castable passes its rule (it wants int8, say): it stays as it is, and the plan check says so.
    return _Choice(i, t, frozenset(), t.dtype, "keep", why, False)


def _keep_whole(plans: list[TensorPlan], choices: list[_Choice], target: str) -> list[str]:
    """One dtype per module and per storage: where members' own choices differ, find one every member accepts
    (``plans``, the plan being made, is corrected in place); returns the notes that say what changed and why."""
    from ..structure import infer_modules

    by_name = {c.tensor.name: c for c in choices}
    parent = {c.index: c.index for c in choices}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        parent[find(a)] = find(b)

    module_of: dict[int, object] = {}
    why_module: dict[int, str] = {}
    for m in infer_modules(c.tensor for c in choices if c.tensor.region == "model"):
        members = [by_name[t.name] for t in m.tensors if t.name in by_name]
        if not m.prefix or len(members) < 2:
            continue  # tensors at the root of a plain dict are not one module
        for c in members[1:]:
            union(members[0].index, c.index)
        reason = _module_reason(m.kind, m.type_name if m.confidence == "fact" else None, [split(c.tensor.name) for c in members])
        for c in members:
            module_of[c.index] = m
            why_module[c.index] = reason
    units: dict[str, list[_Choice]] = {}
    for c in choices:
        units.setdefault(unit_of(c.tensor), []).append(c)
    for members in units.values():
        for c in members[1:]:
            union(members[0].index, c.index)

    out_notes: list[str] = []
    components: dict[int, list[_Choice]] = {}
    for c in choices:
        components.setdefault(find(c.index), []).append(c)
    for members in components.values():
        if len(members) < 2 or len({c.want for c in members}) == 1:
            continue
        dtype = _common_dtype(members, target)
        if dtype is None:
            continue  # no dtype satisfies every member: left to the plan check (module-dtype-mix, tied-dtype-conflict)
        anchors = [c for c in members if c.want == dtype]
        anchors.sort(key=lambda c: not c.held)
        changed: list[_Choice] = [c for c in members if c.want != dtype]
        notes: dict[str, list[str]] = {}
        for c in changed:
            same_module = [a for a in anchors if module_of.get(a.index) is module_of.get(c.index) and c.index in module_of]
            tied = [a for a in anchors if unit_of(a.tensor) == unit_of(c.tensor)]
            if same_module:
                anchor, why = same_module[0], why_module[c.index]
            elif tied:
                anchor, why = tied[0], "tied tensors are one storage and take one dtype"
            elif c.index in why_module:
                anchor, why = anchors[0], why_module[c.index]
            else:
                anchor, why = anchors[0], "tied tensors are one storage and take one dtype"
            verb = "kept" if dtype == c.tensor.dtype else f"{dtype} for"
            notes.setdefault(f"{verb} \0 with {anchor.tensor.name}: {why}", []).append(c.tensor.name)
            action = "keep" if dtype == c.tensor.dtype else "cast"
            plans[c.index] = TensorPlan(c.tensor, dtype, action, f"with {anchor.tensor.name}: {why}")
        for text, names in notes.items():
            out_notes.append(text.replace("\0", ", ".join(names)))
    # Whatever could not be reconciled: names of one storage can only be written one way.
    targets: dict[str, set[str]] = {}
    for c in choices:
        targets.setdefault(unit_of(c.tensor), set()).add(plans[c.index].target)
    for c in choices:
        p = plans[c.index]
        if p.action == "cast" and len(targets[unit_of(c.tensor)]) > 1:
            plans[c.index] = TensorPlan(p.tensor, p.tensor.dtype, "keep", "shares its storage with a tensor that stays as it is")
    return out_notes


def _common_dtype(members: list[_Choice], target: str) -> str | None:
    held = {c.want for c in members if c.held}
    if len(held) > 1:
        return None
    if held:
        # What the user holds wins; a member whose policy disagrees makes the plan check refuse, by name.
        return next(iter(held))
    common = frozenset(dtypes.CASTABLE)
    for c in members:
        common &= c.allowed
    if not common:
        return None
    if target in common:
        return target
    sources = {c.tensor.dtype for c in members}
    if len(sources) == 1 and next(iter(sources)) in common:
        return next(iter(sources))
    return next(d for d in PREFERENCE if d in common)


def split(name: str) -> str:
    return name.rpartition(".")[2]


def _module_reason(kind: str, type_name: str | None, leaves: list[str]) -> str:
    base = type_name or {"batchnorm": "BatchNorm", "linear": "Linear", "conv": "Conv", "embedding": "Embedding", "norm": "norm layer"}.get(
        kind
    )
    if kind == "batchnorm":
        parts = "weight, bias and running statistics"
    else:
        parts = ", ".join(leaves[:-1]) + f" and {leaves[-1]}" if len(leaves) > 1 else leaves[0]
    if base is None:
        return f"one module's {parts} must share a dtype"
    article = "an" if base[0].lower() in "aeiou" else "a"
    return f"{article} {base}'s {parts} must share a dtype"


# -- what the planned output would be ---------------------------------------------------------------


def weights_dtype(inv: Inventory) -> str | None:
    """The dtype from_pretrained should load a model in: the one its compute layers hold (an fp16 model with
    fp32 norms is float16), else the floating dtype with the most bytes."""
    from ..structure import dominant_dtype

    found = dominant_dtype(inv)
    if found is not None:
        return found
    weights = floating_bytes(inv.tensors)
    return weights.most_common(1)[0][0] if weights else None


def plan_config_dtype(plan: Plan) -> str | None:
    """What config.json's dtype becomes: the planned weights' dtype, checked against config-dtype-mismatch so
    that a scan of the result agrees (the check counts bytes; the structure counts compute layers)."""
    declared = plan.source.metadata.get("config_dtype")
    if plan.source.format != Format.HF_DIRECTORY or declared == "auto":
        return None
    from ..checks import check

    out = plan.output_inventory(config_dtype="float32")
    # The config dtype applies to what the loader does not quantize: quantized storage kept as it is does not count.
    held = {p.tensor.name for p in plan.tensors if p.reason == QUANTIZED_KEPT}
    if held:
        out = replace(out, tensors=tuple(t for t in out.tensors if t.name not in held))
    candidates = [weights_dtype(out)]
    candidates += [d for d, _ in floating_bytes(out.tensors).most_common()]
    first = next((c for c in candidates if c), None)
    for c in candidates:
        if c and not any(f.rule == "config-dtype-mismatch" for f in check(plan.output_inventory(config_dtype=c))):
            return c
    return first


WOULD_NOT_RUN = "convert does not write an output whose forward pass would fail"


def with_findings(plan: Plan, policy: Policy | None, *, strict: bool, advise: bool = True) -> Plan:
    """``plan`` with what ``scan`` with ``policy`` (and ``strict``, as the caller decided it) would report on its
    output (``Plan.findings``; ``Plan.failing`` says which fail) and the dtype config.json will name.

    Stricter than ``scan`` in one way: a ``dtype-outlier`` warning (a guess, without ``--model``) on a module the
    plan holds in a castable dtype becomes an error. Scan warns of such a module in a checkpoint it is given;
    convert would be making it, so it refuses instead, naming what holds the module.
    """
    from ..checks import run_checks

    # a dequantized folder's config names the target (make_dequant_plan); a cast one's is decided from its output
    plan = replace(plan, config_dtype=plan.config_dtype or plan_config_dtype(plan))
    # The checks options.effective says apply: the policy's, and its own target's (the command line gives the policy
    # without it where --target replaces it, and checks that target apart: cli_commands.convert).
    found = run_checks(plan.output_inventory(), effective(policy).checks(), strict=strict)[1]
    plan = replace(plan, findings=[_would_not_run(plan, f) for f in found])
    failing = plan.failing(policy)
    return replace(plan, causes=_causes(plan, failing, policy, strict)) if failing and advise else plan


def _causes(plan: Plan, failing: list[Finding], policy: Policy | None, strict: bool) -> tuple[Cause, ...]:
    """The failing findings by cause (``causes.plan_causes``); a way through is named only where the same
    conversion with it passes (planned again from the headers: a folder of plain weights only)."""
    plain = plan.source.format == Format.HF_DIRECTORY and all(p.action != "dequantize" and p.reason != QUANTIZED_KEPT for p in plan.tensors)

    def passes(preset: str | None) -> bool:
        if not plain:
            return False
        other = effective(None, preset=preset).policy if preset else None
        try:
            again = make_plan(plan.source, plan.target, policy=other)
        except DtypeAuditError:
            return False
        return not with_findings(again, other, strict=strict, advise=False).failing(other)

    written = {p.tensor.name: p.target for p in plan.tensors if p.action != "drop"}
    return plan_causes(failing, plan.output_inventory(), written, plan.target, policy, passes)


def _would_not_run(plan: Plan, f: Finding) -> Finding:
    """A dtype-outlier the plan makes: an error, naming what holds the module (--keep, a rule, --keep-unsafe)."""
    if f.rule != "dtype-outlier" or f.actual not in dtypes.CASTABLE or f.tensor is None:
        return f
    held = [p for p in plan.tensors if p.action in ("keep", "leave") and p.tensor.name.rpartition(".")[0] == f.tensor]
    reasons = list(dict.fromkeys(f"{p.tensor.name}: {p.reason}" for p in held if p.reason))
    why = f" (held by {'; '.join(reasons)})" if reasons else ""
    if f.severity == "error":
        return replace(f, message=f.message + why)
    return replace(f, severity="error", message=f"{f.message}; {WOULD_NOT_RUN}{why}")


def _names(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))
