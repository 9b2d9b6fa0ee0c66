"""What a trace records and reports: frozen records, no torch, so renderers and checks read them without it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..dtypes import HALF, is_floating
from ..inventory import CheckpointReport

Phase = Literal["forward", "backward"]

ROOT = ""
"""The module path of the model itself."""
LOSS = "(loss)"
"""Where the operations of the loss that ``--backward`` computes from the output are recorded."""
OUTSIDE = "(autograd)"
"""Backward operations that belong to no forward module (the gradient seed)."""


@dataclass(frozen=True)
class OpRecord:
    """One aten operation as it ran (or failed) on fake tensors, or on real ones in the tests."""

    index: int
    """Position in the run, forward and backward together."""
    phase: Phase
    """``forward`` or ``backward``."""
    module: str
    """Dotted path of the innermost module it ran in (``transformer.h.0.attn``; ``""`` for the model itself);
    in backward, the module whose forward made the autograd node that runs it."""
    op: str
    """The aten overload (``aten.addmm.default``)."""
    inputs: tuple[str, ...]
    """The dtype of each tensor argument, in argument order (lists flattened)."""
    outputs: tuple[str, ...]
    """The dtype of each tensor it returned."""
    nbytes: int = 0
    """Bytes of the new tensors it returned: 0 for views and in-place results."""
    autocast_cast: bool = False
    """A cast that autocast inserted (not one the model's code asked for)."""
    autocast_casts: tuple[tuple[str, str], ...] = ()
    """``(from, to)`` for each input autocast cast for this operation just before it ran."""
    error: str | None = None
    """PyTorch's own message where the operation fails with these dtypes."""
    continued_as: str | None = None
    """After a failure: the dtype its floating inputs were cast to so the run could go on."""
    promotion: tuple[str, str] | None = None
    """``(narrow, wide)`` when a non-scalar floating input was silently widened: its result takes a wider dtype
    that another input brought, and no argument asked for a dtype."""
    view: bool = False
    """A view of an input (``t``, ``view``, ``expand``): it moves no data and computes nothing."""

    @property
    def name(self) -> str:
        """``aten.addmm`` (the overload dropped)."""
        parts = self.op.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else self.op

    @property
    def floating_inputs(self) -> tuple[str, ...]:
        return tuple(d for d in self.inputs if is_floating(d))


@dataclass(frozen=True)
class ModuleCall:
    """One call of one module's forward."""

    module: str
    type: str
    inputs: tuple[str, ...]
    """dtypes of the tensors passed to forward (positional and keyword, flattened)."""
    outputs: tuple[str, ...]
    """dtypes of the tensors it returned; empty when its forward raised."""


@dataclass(frozen=True)
class GradRecord:
    """A parameter after ``--backward``."""

    name: str
    dtype: str
    grad: str | None
    """The gradient's dtype; None when it got no gradient."""


@dataclass(frozen=True)
class InputRecord:
    name: str | None
    """The keyword it was passed by, or None for a positional input."""
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModuleSummary:
    """Per module (children included): what came in, what it computed in, what went out, and what it made."""

    module: str
    type: str
    calls: int
    inputs: tuple[str, ...]
    compute: tuple[str, ...]
    """Floating dtypes of the operations' results inside it."""
    outputs: tuple[str, ...]
    activation_bytes: tuple[tuple[str, int], ...]
    """``(dtype, bytes)`` of the tensors its forward operations made, largest first."""


@dataclass(frozen=True)
class TraceSummary:
    """The ``trace`` section of a report."""

    model: str
    """The model's class name."""
    device: str
    """The device whose kernels and autocast rules the trace follows (``cpu``)."""
    autocast: str | None
    """The autocast dtype, or None."""
    backward: bool
    default_dtype: str
    checkpoint: str | None
    inputs: tuple[InputRecord, ...]
    output: tuple[str, ...]
    """dtypes of the model's output tensors."""
    loss: str | None
    """How the loss was made (``model``: the model's own; ``sum``, ``cross-entropy``); None without --backward."""
    loss_dtype: str | None
    stopped: str | None
    """Where and why the run stopped early (an error outside any operation), else None."""
    ops: tuple[OpRecord, ...]
    calls: tuple[ModuleCall, ...]
    modules: tuple[ModuleSummary, ...]
    activations: tuple[tuple[str, int], ...]
    """``(dtype, bytes)`` of every tensor the forward pass made, largest first (views, in-place results and
    autocast's casts not counted)."""
    grads: tuple[GradRecord, ...]
    autocast_copies: tuple[tuple[str, int], ...] = ()
    """``(dtype, bytes)`` of the copies autocast's casts made (weights cast once per region, and inputs)."""

    def to_dict(self) -> dict[str, Any]:
        total = sum(n for _, n in self.activations) or 1
        return {
            "model": self.model,
            "device": self.device,
            "autocast": self.autocast,
            "backward": self.backward,
            "default_dtype": self.default_dtype,
            "checkpoint": self.checkpoint,
            "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in self.inputs],
            "output": list(self.output),
            "loss": {"kind": self.loss, "dtype": self.loss_dtype} if self.loss else None,
            "stopped": self.stopped,
            "ops_total": len(self.ops),
            "errors": sum(1 for o in self.ops if o.error),
            "activations": [{"dtype": d, "nbytes": n, "share": round(n / total, 6)} for d, n in self.activations],
            "autocast_copies": [{"dtype": d, "nbytes": n} for d, n in self.autocast_copies],
            "modules": [
                {
                    "module": m.module,
                    "type": m.type,
                    "calls": m.calls,
                    "inputs": list(m.inputs),
                    "compute": list(m.compute),
                    "outputs": list(m.outputs),
                    "activation_bytes": dict(m.activation_bytes),
                }
                for m in self.modules
            ],
            "grads": [{"name": g.name, "dtype": g.dtype, "grad": g.grad} for g in self.grads],
            "ops": [op_dict(o) for o in self.ops],
        }


def op_dict(o: OpRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": o.index,
        "phase": o.phase,
        "module": o.module,
        "op": o.op,
        "inputs": list(o.inputs),
        "outputs": list(o.outputs),
        "nbytes": o.nbytes,
    }
    if o.autocast_cast:
        out["autocast_cast"] = True
    if o.autocast_casts:
        out["autocast_casts"] = [list(c) for c in o.autocast_casts]
    if o.promotion is not None:
        out["promotion"] = list(o.promotion)
    if o.error is not None:
        out["error"] = o.error
        out["continued_as"] = o.continued_as
    return out


@dataclass(frozen=True)
class TraceCheckpointReport(CheckpointReport):
    """A checkpoint report whose inventory is the traced model's parameters and buffers, with the trace itself."""

    trace: TraceSummary | None = None


NOT_PROMOTION = frozenset({"aten._to_copy", "aten.copy_", "aten.copy", "aten._copy_from", "aten._copy_from_and_resize"})
"""Conversions: a dtype change there is what was asked for."""
LOW_PRECISION = HALF
"""The half-precision dtypes (``dtypes.HALF``), by the name the trace checks use."""


def unique(items: Iterable[str]) -> tuple[str, ...]:
    """Each item once, in order of first appearance."""
    return tuple(dict.fromkeys(items))
