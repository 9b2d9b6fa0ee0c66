"""``diff A B``: what changed between two checkpoints' inventories (names, dtypes, shapes, sizes)."""

from __future__ import annotations

from dataclasses import dataclass

from .inventory import Inventory, TensorRecord, unique_tensors


@dataclass(frozen=True)
class Change:
    name: str
    before: TensorRecord
    after: TensorRecord

    @property
    def dtype_changed(self) -> bool:
        return self.before.dtype != self.after.dtype

    @property
    def shape_changed(self) -> bool:
        return self.before.shape != self.after.shape


@dataclass(frozen=True)
class InventoryDiff:
    a: Inventory
    b: Inventory
    added: tuple[TensorRecord, ...]
    removed: tuple[TensorRecord, ...]
    changed: tuple[Change, ...]

    @property
    def differs(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    @property
    def bytes_before(self) -> int:
        return sum(t.nbytes for t in unique_tensors(self.a.tensors))

    @property
    def bytes_after(self) -> int:
        return sum(t.nbytes for t in unique_tensors(self.b.tensors))


def diff(a: Inventory, b: Inventory) -> InventoryDiff:
    before, after = a.by_name(), b.by_name()
    added = tuple(t for n, t in after.items() if n not in before)
    removed = tuple(t for n, t in before.items() if n not in after)
    changed = tuple(
        Change(n, t, after[n]) for n, t in before.items() if n in after and (t.dtype != after[n].dtype or t.shape != after[n].shape)
    )
    return InventoryDiff(a, b, added, removed, changed)
