"""The dtype vocabulary: torch's names, their sizes, and how each file format spells them.

No torch import here: scans must stay metadata-only. A test checks every entry against torch itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    """One tensor element type."""

    name: str
    """torch's own name without the ``torch.`` prefix (``float16``, ``bfloat16``)."""
    itemsize: int
    """Bytes per element as torch stores it (packed sub-byte types count one byte)."""
    family: str
    """``float``, ``int``, ``bool``, ``complex``, ``quantized`` or ``bits``."""

    @property
    def is_floating(self) -> bool:
        return self.family == "float"


_TABLE: tuple[tuple[str, int, str], ...] = (
    ("float64", 8, "float"),
    ("float32", 4, "float"),
    ("float16", 2, "float"),
    ("bfloat16", 2, "float"),
    ("float8_e4m3fn", 1, "float"),
    ("float8_e4m3fnuz", 1, "float"),
    ("float8_e5m2", 1, "float"),
    ("float8_e5m2fnuz", 1, "float"),
    ("float8_e8m0fnu", 1, "float"),
    ("float4_e2m1fn_x2", 1, "float"),
    ("complex32", 4, "complex"),
    ("complex64", 8, "complex"),
    ("complex128", 16, "complex"),
    ("int64", 8, "int"),
    ("int32", 4, "int"),
    ("int16", 2, "int"),
    ("int8", 1, "int"),
    ("uint64", 8, "int"),
    ("uint32", 4, "int"),
    ("uint16", 2, "int"),
    ("uint8", 1, "int"),
    *((f"int{n}", 1, "int") for n in range(1, 8)),
    *((f"uint{n}", 1, "int") for n in range(1, 8)),
    ("bool", 1, "bool"),
    ("qint8", 1, "quantized"),
    ("quint8", 1, "quantized"),
    ("qint32", 4, "quantized"),
    ("quint4x2", 1, "quantized"),
    ("quint2x4", 1, "quantized"),
    ("bits8", 1, "bits"),
    ("bits16", 2, "bits"),
    ("bits1x8", 1, "bits"),
    ("bits2x4", 1, "bits"),
    ("bits4x2", 1, "bits"),
)

DTYPES: dict[str, DType] = {name: DType(name, size, fam) for name, size, fam in _TABLE}

ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "byte": "uint8",
    "char": "int8",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
}

# torch.save names a storage by its legacy typed class (``torch.FloatStorage``).
STORAGE_CLASSES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
STORAGE_CLASS_OF: dict[str, str] = {v: k for k, v in STORAGE_CLASSES.items()}

# The safetensors header's dtype codes: the crate's ``Dtype`` enum (safetensors 0.8), each mapped to the
# torch dtype ``safetensors.torch.load_file`` gives it. The crate has no complex128 (``C128`` is refused).
SAFETENSORS_CODES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
# Codes the crate accepts in a header but torch has no dtype for: safe_open opens the file, get_tensor fails.
SAFETENSORS_TORCHLESS: frozenset[str] = frozenset({"F6_E2M3", "F6_E3M2"})
# Bits per element as the crate counts them (its ``Dtype::bitsize``); everything else is 8 x itemsize.
_SAFETENSORS_SUB_BYTE: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# F4 holds two values per byte: the header's shape counts values, torch's (float4_e2m1fn_x2) counts bytes,
# so safetensors halves the last dimension. The writers write torch's shape, so F4 has no code to write.
SAFETENSORS_PACKED: dict[str, int] = {"F4": 2}
SAFETENSORS_CODE_OF: dict[str, str] = {v: k for k, v in SAFETENSORS_CODES.items() if k not in SAFETENSORS_PACKED}


def safetensors_bits(code: str) -> int:
    """Bits per element of a safetensors dtype code the crate knows; KeyError for any other code."""
    if code in _SAFETENSORS_SUB_BYTE:
        return _SAFETENSORS_SUB_BYTE[code]
    return 8 * DTYPES[SAFETENSORS_CODES[code]].itemsize


CASTABLE: frozenset[str] = frozenset({"float64", "float32", "float16", "bfloat16"})
"""The floating dtypes convert casts between, and that torch's CPU kernels compute: the one castable set."""

CONVERSION_TARGETS: dict[str, str] = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
"""What ``convert --to`` accepts (short name -> torch name); torch names and aliases of these three work too."""


HALF: frozenset[str] = frozenset({"float16", "bfloat16"})
"""The 16-bit floating dtypes: what mixed precision computes in, and what a float32 norm or a float32 accumulation
sits beside (``structure``'s module rules, the trace's low-precision checks)."""


def is_floating(name: str) -> bool:
    """Whether a dtype name is a floating type (float8 and float4 included); False for names torch does not know."""
    d = DTYPES.get(name)
    return d is not None and d.is_floating


def conversion_target(spelling: str) -> str:
    """The torch name ``convert --to`` means (``fp16``, ``half``, ``torch.bfloat16`` ...); the one parser of ``--to``."""
    from .errors import UsageError

    target = CONVERSION_TARGETS.get(spelling.strip().lower()) or canonical(spelling)
    if target is None or target not in CONVERSION_TARGETS.values():
        raise UsageError(f"--to must be fp16, bf16 or fp32, not '{spelling}'")
    return target


def short_name(target: str) -> str:
    """``fp16`` for ``float16``: the name output files are given after."""
    return {v: k for k, v in CONVERSION_TARGETS.items()}[target]


def get(name: str) -> DType:
    """The DType for a torch name; KeyError for anything else."""
    return DTYPES[name]


def name_of(dtype: Any) -> str:
    """The name of a torch dtype (or layout) as the reports give it: ``torch.float16`` -> ``float16``. Takes the
    object itself, so that no torch is imported here."""
    return str(dtype).removeprefix("torch.")


def canonical(spelling: str) -> str | None:
    """torch's name for a user's spelling (``fp16``, ``torch.half``), or None if unknown."""
    text = spelling.strip().lower()
    text = text.removeprefix("torch.")
    text = ALIASES.get(text, text)
    return text if text in DTYPES else None
