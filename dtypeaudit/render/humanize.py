"""Numbers and names as people read them; shared by the text and markdown renderers."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..inventory import TensorRecord


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    for limit, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= limit:
            return f"{n / limit:.1f}{suffix}"
    return str(n)


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class TensorGroup:
    """Tensors that differ only in their layer numbers, shown as one row."""

    label: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    count: int
    nbytes: int
    members: tuple[TensorRecord, ...]


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def _label(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    if len({len(p) for p in parts}) != 1:
        return _NUMBER.sub("*", names[0])
    out = []
    for column in zip(*parts, strict=True):
        values = list(dict.fromkeys(column))
        if len(values) == 1:
            out.append(values[0])
        elif all(v.isdigit() for v in values):
            nums = sorted(int(v) for v in values)
            contiguous = nums == list(range(nums[0], nums[-1] + 1))
            out.append(f"{{{nums[0]}..{nums[-1]}}}" if contiguous else "*")
        else:
            out.append("*")
    return ".".join(out)


def group_tensors(tensors: Iterable[TensorRecord]) -> list[TensorGroup]:
    """Merge tensors whose names differ only in numeric components and share dtype, shape and kind."""
    buckets: dict[tuple[object, ...], list[TensorRecord]] = {}
    for t in tensors:
        key = (_NUMBER.sub("*", t.name), t.dtype, t.shape, t.kind, t.file)
        buckets.setdefault(key, []).append(t)
    groups = []
    for members in buckets.values():
        first = members[0]
        groups.append(
            TensorGroup(
                label=_label([m.name for m in members]),
                dtype=first.dtype,
                shape=first.shape,
                kind=first.kind,
                count=len(members),
                nbytes=sum(m.nbytes for m in members),
                members=tuple(members),
            )
        )
    return groups
