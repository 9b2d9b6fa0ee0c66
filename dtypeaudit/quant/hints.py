"""Whether an inventory may hold quantized weights at all: a name, a dtype, the format or config.json's
``quantization_config`` hints at it. Cheap and import-free, so that a scan of an unquantized checkpoint (the
usual case) imports none of the grouping (group.py), its records (model.py) or its checks (checks.py)."""

from __future__ import annotations

from operator import attrgetter, methodcaller

from ..inventory import Format, Inventory, TensorRecord

FLOAT8 = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})
# The tensors that anchor a quantized weight in each family group.py knows (its docstring lists them)
_HINT_SUFFIXES = (".qweight", ".weight_packed", "_blocks", ".SCB", ".absmax", ".quant_map")


def hints_quantization(t: TensorRecord) -> bool:
    return t.dtype in FLOAT8 or t.name.endswith(_HINT_SUFFIXES) or (t.dtype == "int8" and t.name.endswith(".weight"))


def might_be_quantized(inv: Inventory) -> bool:
    """False only where group.view finds no logical weight and quant/consistency.py no finding: no
    ``quantization_config`` key at all, not GGUF, and no tensor that hints at quantization."""
    if "quantization_config" in inv.metadata or inv.format == Format.GGUF:
        return True
    # ``any(hints_quantization(t) for t in inv.tensors)`` in C calls: a scan asks it a few times of a million tensors
    found = set(map(_DTYPE, inv.tensors))
    if not FLOAT8.isdisjoint(found) or any(map(_HINTED, map(_NAME, inv.tensors))):
        return True
    return "int8" in found and any(map(hints_quantization, inv.tensors))


_DTYPE = attrgetter("dtype")
_NAME = attrgetter("name")
_HINTED = methodcaller("endswith", _HINT_SUFFIXES)
