"""GGUF files (llama.cpp), read as llama.cpp's ``gguf_init_from_file`` and the ``gguf`` package's ``GGUFReader`` read
them: header, key/value metadata, tensor infos. Metadata only: no tensor bytes are read.

Layout (GGUF v2 and v3, little-endian; v1's 32-bit counts are refused, as llama.cpp does): ``GGUF``, uint32 version,
uint64 tensor count, uint64 key/value count; each key/value a string key, a uint32 type and its value (arrays: a
uint32 item type, a uint64 count, the items); each tensor info a string name, uint32 n_dims, n_dims uint64 dims
(innermost first), uint32 ggml type, uint64 offset into the data area. The data area starts at the end of the tensor
infos rounded up to ``general.alignment`` (default 32). Strings are a uint64 length and UTF-8 bytes.

Each tensor's shape is reported in PyTorch's order (dims reversed, as ``GGUFReader`` shapes its arrays and as
transformers' GGUF loader builds the weight). Float and integer tensors keep their dtype; a quantized tensor
(``Q4_K``, ``Q8_0`` ...) is recorded as its raw bytes (uint8) and described in ``metadata['gguf_quantized']``, from
which ``quant.group`` makes it a logical weight of its ggml type.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from ..errors import CheckpointError, LimitExceeded
from ..inventory import Inventory, Layout, Span, TensorRecord
from . import locate
from .locate import AnyPath
from .source import Source

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_STRING = 1 << 24
MAX_ARRAY = 1 << 26
MAX_DIMS = 4  # GGML_MAX_DIMS
INT64_MAX = (1 << 63) - 1
CHUNK = 1 << 20

# ggml_type -> (name, elements per block, bytes per block): ggml's type traits (ggml.c), as gguf.constants'
# GGML_QUANT_SIZES lists them (tests/test_gguf.py compares the two).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
PLAIN_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}
"""ggml types that are plain arrays: their torch dtype."""

# GGUF value types: 0 UINT8 .. 12 FLOAT64; 8 is STRING, 9 ARRAY
_UINT32 = 4
_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT = ("general.architecture", "general.name", "general.file_type", "general.quantization_version", "general.alignment")


class _Cursor:
    """Sequential little-endian reads over a Source, a chunk at a time, refusing to run past its end."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.size = src.size
        self.pos = 0
        self.buf = b""
        self.buf_at = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(f"GGUF {what} runs past the end of the file (truncated?)", path=str(self.src.name))
        end = self.pos + n
        if not (self.buf_at <= self.pos and end <= self.buf_at + len(self.buf)):
            self.buf_at = self.pos
            self.buf = self.src.read(self.pos, max(n, min(CHUNK, self.size - self.pos)))
            if len(self.buf) < n:
                raise CheckpointError(f"GGUF {what} runs past the end of the file (truncated?)", path=str(self.src.name))
        out = self.buf[self.pos - self.buf_at : end - self.buf_at]
        self.pos = end
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        if n > MAX_STRING:
            raise LimitExceeded(f"GGUF {what} claims a {n}-byte string, over the {MAX_STRING}-byte cap", path=str(self.src.name))
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"GGUF {what} is not UTF-8", path=str(self.src.name)) from None

    def value(self, kind: int, what: str, *, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            if count > MAX_ARRAY:
                raise LimitExceeded(f"GGUF {what} claims an array of {count} items, over the {MAX_ARRAY} cap", path=str(self.src.name))
            if item == _ARRAY:
                raise CheckpointError(f"GGUF {what} is an array of arrays, which llama.cpp refuses", path=str(self.src.name))
            if item in _SCALARS and not keep:
                self.take(count * struct.calcsize(_SCALARS[item]), what)  # skipped: a tokenizer's scores, token types
                return None
            items = [self.value(item, what, keep=keep) for _ in range(count)]
            return items if keep else None
        raise CheckpointError(f"GGUF {what} has unknown value type {kind}", path=str(self.src.name))


def is_gguf(head: bytes) -> bool:
    return head.startswith(MAGIC)


def read(path: AnyPath | Source, *, file_label: str = "") -> Inventory:
    """The inventory of one GGUF file; CheckpointError (one line) for a malformed one."""
    with locate.opened(path) as src:
        name = str(src.name)
        cur = _Cursor(src)
        if cur.take(4, "magic") != MAGIC:
            raise CheckpointError("is not a GGUF file (no GGUF magic)", path=name)
        version = cur.unpack("<I", "version")
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
            # A version that reads as 2 or 3 byte-swapped: gguf-py's GGUFReader tells the byte order this way.
            raise CheckpointError(
                f"is a big-endian GGUF file (version {version >> 24}); llama.cpp on a little-endian machine does not load "
                "it, and dtypeaudit reads little-endian GGUF only",
                path=name,
            )
        if version not in (2, 3):
            raise CheckpointError(f"GGUF version {version} is not supported (llama.cpp reads 2 and 3)", path=name)
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "key/value count")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise LimitExceeded(
                f"GGUF header claims {n_tensors} tensors and {n_kv} keys, over the caps ({MAX_TENSORS}, {MAX_KV})", path=name
            )
        kept: dict[str, Any] = {}
        seen_keys: set[str] = set()
        for i in range(n_kv):
            key = cur.string(f"key {i}")
            if key in seen_keys:
                raise CheckpointError(f"GGUF key '{key}' is listed twice; llama.cpp refuses the file", path=name)
            seen_keys.add(key)
            kind = cur.unpack("<I", f"type of '{key}'")
            value = cur.value(kind, f"value of '{key}'", keep=key in _KEPT)
            if key in _KEPT:
                kept[key] = value
            if key == "general.alignment" and kind != _UINT32:
                # llama.cpp reads it with gguf_get_val_u32 and GGUFReader checks its type: both refuse another
                raise CheckpointError(f"GGUF general.alignment is stored as type {kind}, not uint32; the loaders refuse it", path=name)
        alignment = kept.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"GGUF general.alignment {alignment!r} is not a power of two", path=name)
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            tname = cur.string(f"tensor {i} name")
            if tname in names:
                raise CheckpointError(f"GGUF tensor '{tname}' is listed twice; llama.cpp refuses the file", path=name)
            names.add(tname)
            n_dims = cur.unpack("<I", f"dims of '{tname}'")
            if n_dims > MAX_DIMS:
                raise CheckpointError(f"GGUF tensor '{tname}' has {n_dims} dims, over ggml's {MAX_DIMS}", path=name)
            dims = [cur.unpack("<Q", f"dims of '{tname}'") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", f"type of '{tname}'")
            offset = cur.unpack("<Q", f"offset of '{tname}'")
            infos.append((tname, dims, ggml_type, offset))
        data_start = -(-cur.pos // alignment) * alignment
        data_size = src.size - data_start
    tensors = []
    quantized: dict[str, list[object]] = {}
    storages: dict[str, Span] = {}
    for tname, dims, ggml_type, offset in infos:
        if ggml_type not in GGML_TYPES:
            raise CheckpointError(f"GGUF tensor '{tname}' has unknown ggml type {ggml_type}", path=name)
        type_name, block, type_size = GGML_TYPES[ggml_type]
        numel = math.prod(dims)
        if dims and dims[0] % block:
            raise CheckpointError(
                f"GGUF tensor '{tname}': its row of {dims[0]} is not a whole number of {type_name} blocks ({block})", path=name
            )
        nbytes = numel // block * type_size
        # ggml's dims are int64, and the elements must be countable in one (llama.cpp); gguf-py's numpy refuses a
        # shape whose bytes, zero dims left out, overflow it: a zero dim beside a huge one is no empty tensor to them
        if math.prod(d for d in dims if d) // block * type_size > INT64_MAX:
            raise CheckpointError(
                f"GGUF tensor '{tname}' has dims {dims}, whose sizes overflow a 64-bit count; llama.cpp and gguf-py refuse it",
                path=name,
            )
        if offset % alignment or offset + nbytes > data_size:
            raise CheckpointError(
                f"GGUF tensor '{tname}' lies at {offset} (+{nbytes} bytes), outside the {data_size}-byte data area or unaligned",
                path=name,
            )
        shape = tuple(reversed(dims))
        storages[tname] = Span(data_start + offset, nbytes)
        dtype = PLAIN_DTYPES.get(type_name)
        if dtype is not None:
            tensors.append(TensorRecord(tname, dtype, shape, nbytes, offset=data_start + offset, file=file_label))
        else:
            quantized[tname] = [type_name, ggml_type, list(shape)]
            tensors.append(TensorRecord(tname, "uint8", (nbytes,), nbytes, offset=data_start + offset, file=file_label))
    meta: dict[str, object] = {
        "gguf": {
            "version": version,
            "alignment": alignment,
            "data_offset": data_start,
            **{k.removeprefix("general."): v for k, v in kept.items()},
        },
    }
    if quantized:
        meta["gguf_quantized"] = quantized
    return Inventory(name, "gguf", tuple(tensors), (), meta, layout=Layout("gguf", storages))
