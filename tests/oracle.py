"""What torch itself sees in a checkpoint: the reference every reader is compared with."""

from __future__ import annotations

from typing import Any

import torch

SAVABLE_DTYPES = [
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool", "bits8", "bits16",
]  # fmt: skip


def walk(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under ``obj`` by dotted key path, as dtypeaudit names them."""
    out: dict[str, torch.Tensor] = {}

    def join(key: Any) -> str:
        return f"{prefix}.{key}" if prefix else str(key)

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(walk(v, join(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(walk(v, join(i)))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            out.update(walk(v, join(k)))
    return out


def facts(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype, shape, kind) as torch reports them."""
    return {
        name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), "parameter" if isinstance(t, torch.nn.Parameter) else "unknown")
        for name, t in tensors.items()
    }


def sharing(tensors: dict[str, torch.Tensor]) -> set[frozenset[str]]:
    """Groups of names (two or more) whose tensors share one storage."""
    groups: dict[int, set[str]] = {}
    for name, t in tensors.items():
        if t.layout != torch.strided or t.is_meta or t.numel() == 0:
            continue  # empty tensors have no memory to share (their data pointers are all null)
        groups.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def load(path: Any) -> dict[str, torch.Tensor]:
    return walk(torch.load(path, weights_only=True, map_location="cpu"))
