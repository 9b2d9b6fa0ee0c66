"""The checks only a live object can fail: torch's default dtype, the batch against the first layer, and dtype drift
between two audits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..dtypes import is_floating
from ..inventory import Finding, Inventory, Severity
from .collection import LiveInventory

if TYPE_CHECKING:
    from ..policy import Policy


def default_dtype_findings(inv: Inventory, policy: Policy | None) -> list[Finding]:
    """``default-dtype``: torch's default dtype at audit time is not the one the policy's ``default_dtype:`` requires."""
    wanted = policy.default_dtype if policy is not None else None
    found = inv.metadata.get("default_dtype")
    if wanted is None or not isinstance(found, str) or found == wanted:
        return []
    return [
        Finding(
            "default-dtype",
            "error",
            f"torch.get_default_dtype() is {found}, but the policy requires {wanted}: layers built from now on, "
            f"torch.tensor(1.0) and torch.zeros(...) are {found} (a torch.set_default_dtype call changed it)",
            expected=(wanted,),
            actual=found,
        )
    ]


def batch_findings(live: LiveInventory) -> list[Finding]:
    """``batch-dtype``: floating batch tensors of another dtype than the first layer of the model they meet.

    Skipped when the first layer is an embedding: its input is integer ids, and the model's own code handles
    floating inputs such as masks.
    """
    first = live.first_layer
    if first is None or "Embedding" in first.type_name:
        return []
    out = []
    for t in live.inventory.tensors:
        if t.name not in live.batch or not is_floating(t.dtype) or t.dtype == first.dtype:
            continue
        out.append(
            Finding(
                "batch-dtype",
                "warning",
                f"the batch holds {t.dtype} but the model's first layer {first.name} ({first.type_name}) is {first.dtype}: "
                f"a Linear or Conv fails on {t.dtype} input ('mat1 and mat2 must have the same dtype', 'expected scalar "
                f"type ... but found ...'), and a loss computed against a {t.dtype} target runs in the wider dtype; "
                f"cast the batch to {first.dtype} where it is loaded",
                tensor=t.name,
                expected=(first.dtype,),
                actual=t.dtype,
            )
        )
    return out


@dataclass(frozen=True)
class Snapshot:
    """The dtypes an audit saw, to compare the next audit with."""

    dtypes: Mapping[str, str]
    """Tensor name -> dtype, for the model's and optimizer's tensors (the batch changes every step)."""
    default_dtype: str | None
    label: str
    """When it was taken (``fit start``, ``epoch 0``)."""


def snapshot(live: LiveInventory, label: str = "the last audit") -> Snapshot:
    default = live.inventory.metadata.get("default_dtype")
    return Snapshot(
        {t.name: t.dtype for t in live.inventory.tensors if t.name not in live.batch},
        default if isinstance(default, str) else None,
        label,
    )


def drift_findings(before: Snapshot, after: Snapshot, *, severity: Severity = "warning") -> list[Finding]:
    """``dtype-drift``: every tensor present in both snapshots whose dtype changed, and a changed default dtype."""
    out = []
    for name, dtype in after.dtypes.items():
        old = before.dtypes.get(name)
        if old is not None and old != dtype:
            out.append(
                Finding(
                    "dtype-drift",
                    severity,
                    f"changed from {old} to {dtype} since {before.label}: a .to()/.half() applied to part of the model, "
                    "or an optimizer or hook that rewrites tensors",
                    tensor=name,
                    expected=(old,),
                    actual=dtype,
                )
            )
    if before.default_dtype and after.default_dtype and before.default_dtype != after.default_dtype:
        out.append(
            Finding(
                "dtype-drift",
                severity,
                f"torch.get_default_dtype() changed from {before.default_dtype} to {after.default_dtype} since {before.label}",
                expected=(before.default_dtype,),
                actual=after.default_dtype,
            )
        )
    return out
