"""What ``tune`` found, as frozen records; no torch, so renderers and the CLI read them without it."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEMA = "dtypeaudit.tune/1"
MAX_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}
SMALLEST_NORMAL = {"float16": 6.103515625e-05, "bfloat16": 1.1754943508222875e-38}


@dataclass(frozen=True)
class ModuleStats:
    """One module of the model, as the fp32 run and its shadow in the target dtype measured it."""

    name: str
    """Its dotted path (``blocks.5.ff``); ``""`` is the model itself."""
    type: str
    """Its class name."""
    calls: int
    """How often the fp32 run called it (0: never, so never kept)."""
    input_abs_max: float
    """The largest absolute value of its floating inputs in the fp32 run."""
    output_abs_max: float
    """The largest absolute value of its floating outputs in the fp32 run."""
    output_abs_min: float
    """The smallest non-zero absolute value of its floating outputs (inf where all are zero)."""
    headroom: float
    """The target dtype's largest finite value over ``output_abs_max``: below 1 its output does not fit."""
    shadow_error: float
    """Its own error in the target dtype: its fp32 inputs fed to its low-precision copy, under the run's metric
    (inf where that copy's output is not finite)."""

    @property
    def fits(self) -> bool:
        """Whether its fp32 output fits the target dtype (a kept module's output is cast back to it on exit)."""
        return self.headroom > 1.0


@dataclass(frozen=True)
class TuneResult:
    """The answer to "which modules must stay fp32 for this model to compute the right thing in ``to``"."""

    to: str
    """The target dtype (``float16`` or ``bfloat16``)."""
    tolerance: float
    metric: str
    """The metric's name (``max-abs-rel``, ``cosine``, ``sqnr``, or the user's ``file.py:func``)."""
    modules: tuple[ModuleStats, ...]
    """Every module, in ``named_modules`` order."""
    first_overflow: str | None
    """In the all-low-precision run, the innermost module whose floating inputs were all finite and whose output
    held inf or NaN (the first to finish so); None where none did."""
    keep: tuple[str, ...]
    """The modules to run in fp32 (no one inside another), in model order."""
    output_error: float
    """The error of the model run with ``keep`` in fp32 (the verifying run; inf where not finite)."""
    all_low_error: float
    """The error of the whole model in the target dtype (inf where not finite)."""
    forward_passes: int
    """Whole-model forward passes the tune took: the fp32 reference (with the shadows), the all-low run, each try
    of the search and the verifying run."""
    passed: bool
    """Whether ``output_error`` is within ``tolerance``."""
    failing: tuple[str, ...] = ()
    """Where none passes: the modules whose shadow error is over the tolerance, worst first."""
    notes: tuple[str, ...] = ()
    """Things the user should know (random inputs, modules that could not be kept)."""

    @property
    def schema(self) -> str:
        return SCHEMA

    def module(self, name: str) -> ModuleStats:
        return next(m for m in self.modules if m.name == name)

    def why_kept(self, name: str) -> str:
        """One line on why ``name`` is kept: its range or its error."""
        m = self.module(name)
        inner = [c for c in self.modules if c.name.startswith(name + ".") and c.calls and not c.fits]
        parts = []
        if inner:
            worst = max(inner, key=lambda c: c.output_abs_max)
            parts.append(f"{worst.name} reaches {worst.output_abs_max:.3g}, over {self.to}'s {MAX_FINITE[self.to]:.6g}")
        if math.isinf(m.shadow_error):
            parts.append(f"its output in {self.to} is not finite")
        else:
            parts.append(f"shadow error {m.shadow_error:.3g} in {self.to}")
        parts.append(f"its own output fits (abs max {m.output_abs_max:.3g})")
        return "; ".join(parts)


def finite_or_none(x: float) -> float | None:
    """JSON has no inf or NaN: a value that is not finite is written null."""
    return x if math.isfinite(x) else None
