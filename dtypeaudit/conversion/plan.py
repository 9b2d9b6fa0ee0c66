"""The conversion plan: what happens to each tensor, decided before any byte is read."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import dtypes
from ..errors import ConversionError, UsageError
from ..inventory import Inventory, TensorRecord, unique_tensors
from ..policy import Matcher, Policy, compile_matcher, decide
from ..values import ValueStats

CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})
TARGETS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor."""

    tensor: TensorRecord
    target: str
    """The dtype it will have (its own when left or kept)."""
    action: str
    """``cast``, ``keep`` (a rule or --keep holds it), ``leave`` (not convertible or already there), ``drop``."""
    reason: str = ""

    def nbytes_as(self, dtype: str) -> int:
        """The tensor's bytes in ``dtype`` (exotic layouts keep their size)."""
        t = self.tensor
        return t.numel * dtypes.get(dtype).itemsize if t.layout == "strided" else t.nbytes

    @property
    def out_nbytes(self) -> int:
        return 0 if self.action == "drop" else self.nbytes_as(self.target)


@dataclass
class Plan:
    source: Inventory
    target: str
    tensors: list[TensorPlan]
    clamp: bool = False
    values: dict[str, ValueStats] = field(default_factory=dict)
    """What each cast does to its unit's values: float16 range checks (NaN/Inf, overflow, underflow,
    subnormals) and the cast's max absolute and relative error, by unit, for every unit cast."""
    notes: list[str] = field(default_factory=list)

    def _unique(self) -> list[TensorPlan]:
        """One plan per tensor, however many names it has (tied weights count once)."""
        first = {id(t) for t in unique_tensors(p.tensor for p in self.tensors)}
        return [p for p in self.tensors if id(p.tensor) in first]

    @property
    def bytes_before(self) -> int:
        return sum(p.nbytes_as(p.tensor.dtype) for p in self._unique())

    @property
    def bytes_after(self) -> int:
        return sum(p.out_nbytes for p in self._unique())

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.tensors:
            out[p.action] = out.get(p.action, 0) + 1
        return out


def unit_of(t: TensorRecord) -> str:
    """The unit of conversion: a storage in torch archives (views and ties convert together), else the tensor."""
    return f"{t.file}\0{t.storage}" if t.storage is not None else f"{t.file}\0{t.name}"


def make_plan(
    inv: Inventory,
    to: str,
    *,
    policy: Policy | None = None,
    keep: tuple[str, ...] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
) -> Plan:
    target = TARGETS.get(to, dtypes.canonical(to) or to)
    if target not in TARGETS.values():
        raise UsageError(f"--to must be fp16, bf16 or fp32, not '{to}'")
    if inv.format in ("torchscript", "dcp", "factory", "pickle"):
        raise ConversionError(_REFUSALS[inv.format], path=inv.path)
    keepers: list[Matcher] = []
    for pattern in keep:
        try:
            keepers.append(compile_matcher(pattern))
        except ValueError as exc:
            raise UsageError(f"--keep {pattern!r}: {exc}") from None

    def one(t: TensorRecord) -> TensorPlan:
        if strip_optimizer and t.region == "optimizer":
            return TensorPlan(t, t.dtype, "drop", "optimizer state stripped (--strip-optimizer)")
        if t.dtype not in CASTABLE or t.layout != "strided":
            what = t.layout if t.layout != "strided" else t.dtype
            return TensorPlan(t, t.dtype, "leave", f"{what} tensors are left exactly as they are")
        if t.region == "optimizer" and not include_optimizer:
            return TensorPlan(t, t.dtype, "leave", "optimizer state is left as is (--include-optimizer to cast it)")
        for m in keepers:
            if m(t.name):
                return TensorPlan(t, t.dtype, "keep", f"--keep {m.text}")
        want = target
        if policy is not None and not decide(policy, t.with_(dtype=target)).ok:
            d = decide(policy, t)
            if d.ok:
                return TensorPlan(t, t.dtype, "keep", f"policy: {d.rule.label if d.rule else 'default'} expects {_names(d.expected)}")
            choices = sorted((d.expected or frozenset()) & CASTABLE)
            if len(choices) != 1:
                return TensorPlan(t, t.dtype, "keep", f"policy expects {_names(d.expected)}")
            want = choices[0]
        if t.dtype == want:
            return TensorPlan(t, want, "leave", f"already {want}")
        return TensorPlan(t, want, "cast")

    plans = [one(t) for t in inv.tensors]
    # Tensors that share one storage convert together, or not at all.
    units: dict[str, set[str]] = {}
    for p in plans:
        if p.action != "drop":
            units.setdefault(unit_of(p.tensor), set()).add(p.target)
    for i, p in enumerate(plans):
        if p.action == "cast" and len(units[unit_of(p.tensor)]) > 1:
            plans[i] = TensorPlan(p.tensor, p.tensor.dtype, "keep", "shares its storage with a tensor that stays as it is")
    return Plan(inv, target, plans, clamp=clamp)


def _names(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


_REFUSALS = {
    "torchscript": "TorchScript archives carry compiled code and constants typed for the saved dtypes, so their weights "
    "cannot be recast safely; convert the eager model's state_dict and script it again",
    "dcp": "torch.distributed.checkpoint directories are written by the training job; convert them with "
    "torch.distributed.checkpoint.format_utils.dcp_to_torch_save first, then convert the .pt",
    "factory": "a factory builds a model, it is not a checkpoint file to convert",
    "pickle": "a bare pickle is not a torch.save checkpoint; nothing in it can be converted without running it",
}
