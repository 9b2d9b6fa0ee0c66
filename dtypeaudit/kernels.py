"""What PyTorch's kernels do with a module's dtypes, per backend, and the verdict that holds on every one of them.

``data/kernels.json`` records, for each kernel and each combination of input, weight, bias and running-statistic
dtype, what a real forward did on each backend where it was measured (``scripts/measure_kernels.py`` measures a
backend, a CPU ISA with oneDNN on or off, running the cases of ``tests/kernel_cases.py``). CPU kernels differ by
ISA: on AVX-512 CPUs oneDNN runs bfloat16 (and on AVX-512 FP16 / AMX ones float16) transposed convolutions and
refuses a bias of another dtype, where AVX2's kernels accept it. A checkpoint's verdict must hold wherever it is
loaded, so the strictest known outcome wins: if any backend raises, the forward fails, and the finding names the
backends that refuse it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

RAISE = "raise"
TABLE = Path(__file__).resolve().parent / "data" / "kernels.json"

# Module types that run one measured kernel family. Shapes differ, the dtype checks do not: ATen runs a 1-d
# convolution as a 2-d one, SyncBatchNorm outside distributed training is batch_norm, transformers' Conv1D (GPT-2)
# is addmm(bias, x, weight) like Linear. A type's verdict is the strictest over every measured member of its family.
_FAMILIES: tuple[tuple[frozenset[str], tuple[str, ...]], ...] = (
    (frozenset({"Conv1d", "Conv2d", "Conv3d", "LazyConv1d", "LazyConv2d", "LazyConv3d"}), ("Conv1d", "Conv2d")),
    (
        frozenset({"ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "LazyConvTranspose1d", "LazyConvTranspose2d"}),
        ("ConvTranspose1d", "ConvTranspose2d"),
    ),
    (frozenset({"Linear", "LazyLinear", "NonDynamicallyQuantizableLinear", "Conv1D"}), ("Linear",)),
    (
        frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"}),
        ("BatchNorm1d", "BatchNorm2d"),
    ),
    (
        frozenset({"InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d"}),
        ("InstanceNorm2d",),
    ),
    (frozenset({"LayerNorm"}), ("LayerNorm",)),
    (frozenset({"GroupNorm"}), ("GroupNorm",)),
    (frozenset({"RMSNorm"}), ("RMSNorm",)),
    (frozenset({"Embedding"}), ("Embedding",)),
)


def measured_kernels(type_name: str) -> tuple[str, ...]:
    """The kernels of the table that ``type_name`` runs, ``()`` if none was measured."""
    for members, kernels in _FAMILIES:
        if type_name in members:
            return kernels
    return ()


class Verdict(NamedTuple):
    """What a forward does on every backend the table knows for one row."""

    result: str
    """The strictest outcome: ``raise``, or the dtype it returns where every backend runs it."""
    raising: tuple[str, ...]
    """The backends where it raises."""
    running: tuple[str, ...]
    """The backends where it runs."""

    @property
    def disagreement(self) -> str | None:
        """Where backends disagree, in words for a finding: which ones are stricter; else None."""
        if not self.raising or not self.running:
            return None
        return f"it raises on {describe(self.raising)} though it runs on {describe(self.running)}; the strictest backend decides"


class Table(NamedTuple):
    """The measurements, one full row set per backend."""

    backends: dict[str, dict[str, str]]
    """Backend -> where (``measured_on``), on which torch (``torch``) and how (``how``) it was measured."""
    outcomes: dict[str, dict[str, str]]
    """Backend -> row key -> ``raise``, or the dtype the forward returned."""


def expand(doc: Mapping[str, Any]) -> Table:
    """The file's base table and per-backend differences, as every backend's rows.

    A backend's entry holds its record and either ``only`` (its rows, where it measured few) or the base rows it
    ``differs`` on and those it left ``unmeasured``.
    """
    base: dict[str, str] = doc["base"]
    backends: dict[str, dict[str, str]] = {}
    outcomes: dict[str, dict[str, str]] = {}
    for backend, entry in doc["backends"].items():
        backends[backend] = {k: entry[k] for k in ("how", "measured_on", "torch")}
        if "only" in entry:
            rows = dict(entry["only"])
        else:
            unmeasured = set(entry.get("unmeasured", ()))
            rows = {k: v for k, v in base.items() if k not in unmeasured} | entry.get("differs", {})
        outcomes[backend] = rows
    return Table(backends, outcomes)


@cache
def table() -> Table:
    """The shipped table, read on first use: only a module whose type ``--model`` gave looks a row up."""
    return expand(json.loads(TABLE.read_text(encoding="utf-8")))


def describe(backends: tuple[str, ...]) -> str:
    """``cpu-avx512-onednn-bf16 (measured on ...)``: a backend and where it was measured, for a message."""
    known = table().backends
    return ", ".join(f"{b} ({known[b]['measured_on']})" if b in known else b for b in backends)


def row_key(kernel: str, x: str, leaves: Mapping[str, str]) -> str:
    """The table's key, as ``tests/kernel_cases.py`` spells it."""
    return f"{kernel} {x} " + " ".join(f"{leaf}={d}" for leaf, d in leaves.items())


def outcomes(kernel: str, x: str, leaves: Mapping[str, str]) -> dict[str, str]:
    """Backend -> what ``kernel`` did with input ``x`` and these leaf dtypes, where it was measured."""
    key = row_key(kernel, x, leaves)
    return {backend: rows[key] for backend, rows in table().outcomes.items() if key in rows}


def verdict(type_name: str, x: str, leaves: Mapping[str, str]) -> Verdict | None:
    """The strictest known outcome of a ``type_name`` module's forward; None where no backend measured the row.

    ``leaves`` are the kernel's floating tensors in the table's order (``weight``, ``bias``, ``stats``).
    """
    found: dict[str, str] = {}
    for kernel in measured_kernels(type_name):
        for backend, entry in outcomes(kernel, x, leaves).items():
            if found.get(backend) != RAISE:
                found[backend] = entry
    if not found:
        return None
    raising = tuple(sorted(b for b, e in found.items() if e == RAISE))
    running = tuple(sorted(b for b, e in found.items() if e != RAISE))
    results = {found[b] for b in running}
    if raising:
        return Verdict(RAISE, raising, running)
    if len(results) != 1:
        return None  # backends run it but return different dtypes: not a rule the table can give
    return Verdict(results.pop(), raising, running)
