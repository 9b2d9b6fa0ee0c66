"""Dequantizers: one pure function per quantization layout, CPU torch tensors in, the logical weight out.

Each one computes in the order its reference loader does, so that the result is bit-equal to what that
loader gives the model (the reference is named at each function; tests/test_dequant.py compares them on
the same data). Each returns the weight in its *natural* dtype, the one the loader computes in (the scale
dtype, or float32 where the loader computes in float32); the conversion then casts it to the target as it
casts any other tensor. Anything a function cannot dequantize exactly raises ``ConversionError``: a wrong
weight is never written. torch is imported inside the functions (the light install has none).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import ConversionError
from . import model as qm

if TYPE_CHECKING:
    import torch

# OCP MX / NVFP4 fp4 e2m1: the 16 codes in order (bit 3 is the sign); as transformers' FP4_VALUES and
# compressed-tensors' kE2M1ToFloat with its sign applied.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# AutoAWQ packs eight 4-bit columns into one int32 in this order: nibble i holds column AWQ_ORDER[i]
# (awq/utils/packing_utils.py: AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]); unpacking reads nibble
# AWQ_REVERSE[j] for column j.
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def _refuse(name: str, why: str) -> ConversionError:
    return ConversionError(f"cannot dequantize '{name}' exactly: {why}; refused")


# ---------------------------------------------------------------------------------------------- FP8
def to_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.float32)``, for float8 through a 256-entry table that torch's own conversion fills: the same
    values (NaN included), three times faster than torch's element-wise float8 conversion on CPU."""
    import torch

    if x.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        return x.to(torch.float32)
    import numpy as np

    table = torch.arange(256, dtype=torch.uint8).view(x.dtype).to(torch.float32).numpy()
    codes = x.contiguous().view(torch.uint8).numpy()
    out = np.empty(codes.shape, dtype=np.float32)
    np.take(table, codes, out=out)
    return torch.from_numpy(out)


def e8m0_float32(exponents: Any) -> Any:
    """uint8 E8M0 exponents (numpy) as the float32 scales they stand for, ``2 ** (byte - 127)``: what
    ``Fp8Dequantize`` computes for a uint8 ``weight_scale_inv`` (``(s.to(float32) - 127).exp2()``), bit-equal
    (exact powers of two; 255 is inf, 0 the subnormal 2^-127)."""
    import numpy as np

    with np.errstate(over="ignore"):
        table = np.ldexp(np.float32(1), np.arange(256, dtype=np.int32) - 127).astype(np.float32)
    return table[exponents]


def fp8_scale_float32(scale_inv: torch.Tensor) -> torch.Tensor:
    """A ``weight_scale_inv`` as the float32 multipliers the loader applies: a uint8 one holds E8M0 exponents
    (MXFP8), any other dtype is widened (float8_e8m0fnu included)."""
    import torch

    if scale_inv.dtype == torch.uint8:
        return torch.from_numpy(e8m0_float32(scale_inv.contiguous().numpy()))
    return scale_inv.to(torch.float32)


def unpack_fp4(packed_values: torch.Tensor) -> torch.Tensor:
    """Two fp4 e2m1 values a byte, the low nibble first, as float32 twice as wide in the last dim: what
    ``Fp8Dequantize._unpack_fp4`` makes of an int8 weight beside a ``weight_scale_inv``."""
    import torch

    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    u8 = packed_values.contiguous().view(torch.uint8)
    values = torch.stack((lut[(u8 & 0x0F).long()], lut[(u8 >> 4).long()]), dim=-1)
    return values.reshape(*packed_values.shape[:-1], 2 * packed_values.shape[-1])


def fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor | None, block: Sequence[int] | None) -> torch.Tensor:
    """transformers' ``fp8`` method as from_pretrained dequantizes it on CPU (``Fp8Dequantize._dequantize_one``):
    ``weight`` (float8, or any float dtype: the loader scales whatever ``X.weight`` has an ``X.weight_scale_inv``)
    ``[..., rows, cols]`` times ``weight_scale_inv`` ``[..., rows/bm, cols/bn]``, one scale per block, both sides
    in float32 (a uint8 scale is E8M0: :func:`fp8_scale_float32`), multiplied once; the result is float32 (the
    loader casts it to the model's dtype next). ``block`` the loader's block (``group._loader_block``: the grid
    divides the weight exactly; the code also reads DeepSeek's partial edge blocks); None or a one-value scale:
    every element times that scale. ``scale_inv`` None: the weight unscaled (a float8 weight without a scale,
    which the loader casts). An int8 weight is packed fp4 e2m1 (:func:`unpack_fp4`), as the loader reads it."""
    import torch

    w = unpack_fp4(weight) if weight.dtype == torch.int8 else to_float32(weight)
    if scale_inv is None:
        return w
    s = fp8_scale_float32(scale_inv)
    if block is None or s.numel() == 1:
        if s.numel() != 1:
            raise _refuse("weight", f"a per-tensor weight_scale_inv has {s.numel()} values")
        return w.mul_(s.reshape(()))
    bm, bn = int(block[0]), int(block[1])
    rows, cols = w.shape[-2:]
    want = (*w.shape[:-2], math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(s.shape[-2:]) != want[-2:] or math.prod(s.shape[:-2]) not in (1, math.prod(want[:-2])):
        raise _refuse("weight", f"weight_scale_inv has shape {list(s.shape)}, blocks of {bm}x{bn} over {list(w.shape)} need {list(want)}")
    s = s.reshape(want) if math.prod(s.shape[:-2]) == math.prod(want[:-2]) else s.reshape(want[-2:])
    # Expand the scales over rows only and broadcast them over the columns through a view of the
    # weight, as transformers' _dequantize_fp8_weight does: no second weight-sized tensor.
    s = s.repeat_interleave(bm, dim=-2)[..., :rows, :]
    full, rem = divmod(cols, bn)
    if full:
        w[..., : full * bn].unflatten(-1, (full, bn)).mul_(s[..., :full, None])
    if rem:
        w[..., full * bn :].mul_(s[..., full:])
    return w


# float8 formats: (exponent bits, mantissa bits, exponent bias, NaN code rule). "fn" formats have no inf and one NaN
# per sign (all exponent and mantissa bits set); "fnuz" formats have no inf, no -0 and one NaN, 0x80; e5m2 is IEEE.
FLOAT8_FORMATS = {
    "float8_e4m3fn": (4, 3, 7),
    "float8_e5m2": (5, 2, 15),
    "float8_e4m3fnuz": (4, 3, 8),
    "float8_e5m2fnuz": (5, 2, 16),
}


@cache  # once per dtype, not once per piece (a 2 GB checkpoint has thousands); read-only, shared
def float8_values(dtype: str) -> Any:
    """float32 ``[256]``: the value of each code of a float8 dtype, bit-equal to torch's conversion (c10's
    ``fp8e4m3fn_to_fp32_value`` and friends), NaN bits included: e4m3fn keeps its mantissa bits in the NaN,
    e5m2 widens as float16 does (quieted), the fnuz formats' NaN (0x80) is ``0x7F800001``. No torch needed."""
    import numpy as np

    ebits, mbits, bias = FLOAT8_FORMATS[dtype]
    code = np.arange(256, dtype=np.uint32)
    sign = (code >> 7) << 31
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    # normal numbers: the exponent rebiased, the mantissa moved to float32's top mantissa bits (exact)
    bits = sign | ((exp + 127 - bias) << 23) | (man << (23 - mbits))
    # subnormals (and zero): man * 2^(1 - bias - mbits), exact in float32
    sub = np.ldexp(man.astype(np.float32), 1 - bias - mbits).view(np.uint32) | sign
    bits = np.where(exp == 0, sub, bits)
    top = (1 << ebits) - 1
    if dtype == "float8_e4m3fn":
        nan = (exp == top) & (man == (1 << mbits) - 1)
        bits = np.where(nan, sign | 0x7F800000 | (man << (23 - mbits)), bits)
    elif dtype == "float8_e5m2":
        special = exp == top
        bits = np.where(special, sign | 0x7F800000 | (man << (23 - mbits)) | np.where(man > 0, 0x400000, 0), bits)
    else:
        bits = np.where(code == 0x80, 0x7F800001, bits)
    values = bits.astype(np.uint32).view(np.float32)
    values.flags.writeable = False
    return values


# torch's vectorised CPU cast to bfloat16 (ATen's cvtfp32_bf16) writes every NaN as 0xFFFF.
_BF16_NAN = 0xFFFF


def fp8_block_tables(values: Any, scale: Any, target: str, *, clamp: bool = False) -> tuple[Any, Any]:
    """Every block's results: ``values`` float32 ``[256]`` (the codes' values) times each float32 block scale,
    rounded once to ``target`` as torch's cast does (stored form, :mod:`dtypeaudit.npcast`; ``clamp``: values beyond
    its range saturate, as ``convert --clamp`` casts), shape ``[*scale.shape, 256]``; and the float32 products
    themselves, the same shape (what the value checks judge)."""
    import numpy as np

    from ..npcast import cast

    with np.errstate(all="ignore"):  # NaN and inf codes, and products beyond float32, are results like any other
        products = scale[..., None] * values  # float32 times float32: the loader's one multiply per element
    flat = products.reshape(-1)
    tables = cast(flat, "float32", target, clamp=clamp)
    if target == "bfloat16":
        tables[np.isnan(flat)] = _BF16_NAN
    return tables.reshape(products.shape), products


# The codes whose value is NaN or Inf, whatever the scale: ``code & mask == bits`` (tests/test_dequant.py holds
# each against float8_values).
SPECIAL_CODES = {
    "float8_e4m3fn": (0x7F, 0x7F),
    "float8_e5m2": (0x7C, 0x7C),
    "float8_e4m3fnuz": (0xFF, 0x80),
    "float8_e5m2fnuz": (0xFF, 0x80),
}


def _plain(products: Any, fp8: str, target: str) -> Any:
    """Which entries of the tables a value check has nothing to say of: finite codes whose product the target
    holds in its normal range (or exactly zero)."""
    import numpy as np

    from ..values import F16_NORMAL_FROM, INF_FROM

    magnitude = products.view(np.uint32) & np.uint32(0x7FFFFFFF)
    plain = magnitude < INF_FROM[target]
    if target == "float16":
        plain &= (magnitude >= F16_NORMAL_FROM) | (magnitude == 0)
    mask, bits = SPECIAL_CODES[fp8]
    plain[..., (np.arange(256) & mask) == bits] = True  # judged by the codes themselves (see fp8_block_cast_np)
    return plain


def fp8_block_gather(codes: Any, tables: Any, block: Sequence[int]) -> Any:
    """``out[r, c] = tables[r // bm, c // bn, codes[r, c]]`` for 2-D uint8 ``codes``: each code looked up in its
    block's table, in whole rows."""
    import numpy as np

    bm, bn = int(block[0]), int(block[1])
    rows, cols = codes.shape
    nr, nc = tables.shape[:2]
    out = np.empty((rows, cols), dtype=tables.dtype)
    # Whole rows at a time, not block by block: column c reads table (i, c // bn), which starts at (c // bn) * 256
    # in row i's tables laid end to end. A uint16 index where the tables fit one (65536 entries: up to 256 blocks
    # a row): adding to it costs a quarter of an intp add, and take widens it faster than a mixed-type add does
    # (1.8 against 2.4 ns an element, measured). About 128K elements a step keep the index, widened by take,
    # in a 1 MiB L2 (64 rows of 2048 columns: 2.3 ns an element, against 2.5 for 32 rows and 4 for 64 rows of 8192).
    index_type = np.uint16 if nc * 256 <= 1 << 16 else np.intp
    column_table = ((np.arange(cols) // bn) * 256).astype(index_type)
    step = max(1, min(bm, rows, (1 << 17) // max(1, cols)))
    index = np.empty((step, cols), dtype=index_type)
    for i in range(nr):
        tables_i = tables[i].reshape(-1)
        for r0 in range(i * bm, min(rows, (i + 1) * bm), step):
            r1 = min(rows, (i + 1) * bm, r0 + step)
            np.add(column_table, codes[r0:r1], out=index[: r1 - r0])
            # every index is in range by construction (a code below 256 plus its block's offset): "wrap" only
            # skips the error path of the default "raise" mode (15-20% faster on this uint16 index, measured)
            np.take(tables_i, index[: r1 - r0], out=out[r0:r1], mode="wrap")
    return out


def fp8_block_cast_np(codes: Any, scale: Any, fp8: str, block: Sequence[int], target: str, *, clamp: bool = False) -> tuple[Any, Any]:
    """``fp8_block(weight, scale_inv, block).to(target)`` for a 2-D weight, with numpy alone: ``codes`` the weight's
    bytes (uint8 ``[rows, cols]``), ``scale`` its float32 block scales, ``fp8`` its float8 dtype. Returns the
    result in the target's stored form (bfloat16 as uint16 bits) and, where a value check may have something to
    say (a NaN or Inf code, a product beyond the target's range or, for float16, below its normal range), the
    float32 products themselves (``fp8_block(...)``, for the checks to fold), else None: every value is finite and
    plainly held. Within one block every element is ``float32(code) * scale`` rounded to the target, so a block's
    256 possible results are computed once, exactly as :func:`fp8_block` computes each element, and each code
    looked up: bit-equal to it, NaN codes included, in one pass over the codes instead of four over float32
    products (a second, of the products, only where the checks need them)."""
    import numpy as np

    bm, bn = int(block[0]), int(block[1])
    rows, cols = codes.shape
    want = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale.shape) != want:
        raise _refuse(
            "weight", f"weight_scale_inv has shape {list(scale.shape)}, blocks of {bm}x{bn} over {[rows, cols]} need {list(want)}"
        )
    if scale.dtype == np.uint8:
        scale = e8m0_float32(scale)
    if scale.dtype != np.float32:
        raise _refuse("weight", f"block scales must be float32 here, not {scale.dtype}")
    tables, products = fp8_block_tables(float8_values(fp8), scale, target, clamp=clamp)
    out = fp8_block_gather(codes, tables, block)
    mask, bits = SPECIAL_CODES[fp8]
    # the NaN/Inf codes by a bit test over the codes (cheap: every table holds their entries); the rest by the tables
    special = bool(np.any(np.bitwise_and(codes, mask) == bits))
    if special or not _plain(products, fp8, target).all():
        return out, fp8_block_gather(codes, products, block)
    return out, None


def fp8_block_cast(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int], target: str) -> torch.Tensor:
    """:func:`fp8_block_cast_np` on torch tensors: ``fp8_block(weight, scale_inv, block).to(target)``, bit-equal."""
    import torch

    codes = weight.contiguous().view(torch.uint8).numpy()
    scale = fp8_scale_float32(scale_inv).contiguous().numpy()
    out, _ = fp8_block_cast_np(codes, scale, dtypes.name_of(weight.dtype), block, target)
    return torch.from_numpy(out).view(getattr(torch, target))


# -------------------------------------------------------------------------------- compressed-tensors
def _expand(scale: torch.Tensor, shape: Sequence[int], strategy: str, group: Sequence[int] | None) -> torch.Tensor:
    """A scale (or zero point) laid over a ``shape`` weight by strategy: broadcastable, values unchanged."""
    rows, cols = int(shape[-2]), int(shape[-1])
    if strategy == "tensor":
        if scale.numel() != 1:
            raise _refuse("weight", f"a per-tensor scale has {scale.numel()} elements")
        return scale.reshape(())
    if strategy == "channel":
        if scale.numel() != rows:
            raise _refuse("weight", f"a per-channel scale has shape {list(scale.shape)} for {rows} rows")
        return scale.reshape(rows, 1)
    if strategy in ("group", "tensor_group"):
        g = int(group[-1]) if group else 0
        if g <= 0 or cols % g or tuple(scale.shape[-2:]) != (rows, cols // g):
            raise _refuse("weight", f"group scale {list(scale.shape)} does not fit group size {g} over {list(shape)}")
        return scale.repeat_interleave(g, dim=-1)
    if strategy == "block":
        if not group or len(group) != 2:
            raise _refuse("weight", "a block strategy without its block structure")
        bm, bn = int(group[0]), int(group[1])
        if tuple(scale.shape[-2:]) != (math.ceil(rows / bm), math.ceil(cols / bn)):
            raise _refuse("weight", f"block scale {list(scale.shape)} does not fit {bm}x{bn} blocks over {list(shape)}")
        return scale.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    raise _refuse("weight", f"compressed-tensors strategy '{strategy}' for weights")


def compressed(
    values: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    strategy: str,
    group: Sequence[int] | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors' ``dequantize`` (quantization/lifecycle/forward_helpers.py ``_dequantize``):
    the quantized values (int8, float8, or unpacked int4) cast to the scale's dtype, the zero point
    (cast the same way) subtracted, times the scale (divided by the global scale first where there is one);
    the result in the scale's dtype."""
    if global_scale is not None:
        scale = scale / global_scale
    s = _expand(scale, values.shape, strategy, group)
    out = values.to(scale.dtype)
    if zero is not None:
        out = out - _expand(zero, values.shape, strategy, group).to(scale.dtype)
    return out * s


def unpack_int32(packed: torch.Tensor, bits: int, length: int, *, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` reversed (compressors/pack_quantized/helpers.py): value i of a
    row lives in bits ``[i*bits, (i+1)*bits)`` of the row's words, stored unsigned (offset by
    ``2**(bits-1)``); ``dim`` 0 packs down the columns (zero points). Returns int8 values. Only widths that
    divide 32 are read: for the others, older compressed-tensors left bits unused in each word and newer
    ones pack densely, and the file does not say which wrote it."""
    import torch

    if packed.dtype != torch.int32:
        raise _refuse("weight_packed", f"packed values are {str(packed.dtype).removeprefix('torch.')}, not int32")
    if bits not in (1, 2, 4, 8):
        raise _refuse("weight_packed", f"{bits}-bit values straddle int32 words, packed differently by compressed-tensors versions")
    if dim == 0:
        return unpack_int32(packed.transpose(0, 1), bits, length, dim=1).transpose(0, 1)
    words = packed.shape[-1]
    if words * (32 // bits) < length:
        raise _refuse("weight_packed", f"{words} int32 words per row cannot hold {length} {bits}-bit values")
    unsigned = _unpack_cols(packed, bits)[..., :length]
    return (unsigned - (1 << (bits - 1))).to(torch.int8)


def packed(
    packed_values: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    *,
    shape: Sequence[int],
    bits: int,
    strategy: str,
    group: Sequence[int] | None = None,
) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` (``PackedQuantizationCompressor.decompress``): values unpacked
    from int32 to int8, the zero point (packed down its columns) likewise, then :func:`compressed`."""
    import torch

    if len(shape) != 2:
        raise _refuse("weight_packed", f"weight_shape {list(shape)} is not 2-D")
    rows, cols = int(shape[0]), int(shape[1])
    if packed_values.shape[0] != rows:
        raise _refuse("weight_packed", f"{packed_values.shape[0]} packed rows for weight_shape {list(shape)}")
    values = unpack_int32(packed_values, bits, cols)
    zp = None
    if zero is not None:
        zp = unpack_int32(zero, bits, rows, dim=0) if zero.dtype == torch.int32 else zero
    return compressed(values, scale, zp, strategy=strategy, group=group)


def nvfp4(packed_values: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, *, group: int = 16) -> torch.Tensor:
    """compressed-tensors ``nvfp4-pack-quantized`` (``NVFP4PackedCompressor.decompress``): two fp4 e2m1
    values per uint8 (low nibble first) looked up in float32 and cast to bfloat16, the float8 group scales
    cast to bfloat16, divided by the float32 global scale, multiplied, and the product cast to bfloat16."""
    import torch

    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    rows, half = packed_values.shape
    u8 = packed_values.contiguous().view(torch.uint8)
    values = torch.stack((lut[(u8 & 0x0F).long()], lut[(u8 >> 4).long()]), dim=-1).reshape(rows, half * 2)
    values = values.to(torch.bfloat16)
    s = scale.to(torch.bfloat16)
    return compressed(values, s, None, strategy="group", group=(group,), global_scale=global_scale).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------- MXFP4
def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4 experts (transformers ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``):
    ``blocks`` uint8 ``[E, rows, G, 16]`` (two e2m1 per byte, low nibble first), ``scales`` uint8
    ``[E, rows, G]`` e8m0 exponents biased by 127; the value is ``lut[nibble] * 2**(scale-127)``, laid out
    ``[E, rows, G*32]`` and transposed to the parameter's ``[E, G*32, rows]``. float32: every product is
    exact there (the loader computes in the target dtype, which rounds once, as the cast after this does)."""
    import torch

    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16 or blocks.ndim < 3:
        raise _refuse("blocks", f"blocks {list(blocks.shape)} and scales {list(scales.shape)} are not an MXFP4 pair")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    u8 = blocks.contiguous().view(torch.uint8)
    values = torch.stack((lut[(u8 & 0x0F).long()], lut[(u8 >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    exp = scales.contiguous().view(torch.uint8).to(torch.int32) - 127
    out = torch.ldexp(values.reshape(*blocks.shape[:-1], 32), exp.unsqueeze(-1).to(torch.float32))
    *prefix, g, _ = blocks.shape
    out = out.reshape(*prefix, g * 32)
    return out.transpose(-1, -2).contiguous()


# ------------------------------------------------------------------------------------------- GPTQ / AWQ
def _unpack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words -> ``32/bits`` unsigned values each, value i in bits ``[i*bits, (i+1)*bits)``, laid along
    the last dim (GPTQ's qzeros; AWQ's qweight and qzeros before their reorder)."""
    import torch

    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (q.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*q.shape[:-1], q.shape[-1] * per)


def _unpack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: ``32/bits`` input rows per int32, row ``k`` in word ``k // per`` at bit ``(k % per)*bits``."""
    import torch

    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).reshape(1, per, 1)
    vals = (q.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(q.shape[0] * per, q.shape[1])


def gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    in_features: int | None = None,
    zero_offset: int = 1,
) -> torch.Tensor:
    """GPTQ (AutoGPTQ ``qlinear_cuda_old`` / gptqmodel torch kernel): ``qweight`` int32 ``[in/per, out]``
    packed down the input dim, ``qzeros`` int32 ``[groups, out/per]`` packed along the output dim,
    ``scales`` ``[groups, out]``, ``g_idx`` (input row -> group; ``k // group_size`` where absent).
    ``W[k, n] = scales[g, n] * (q[k, n] - (z[g, n] + zero_offset))``: the integer difference first, then
    one multiply in the scale's dtype. ``zero_offset`` is 1 for the original GPTQ format (it stored
    ``zero - 1``) and 0 for gptqmodel's ``gptq_v2``. Returns ``[out, in]`` (the Linear's weight)."""
    import torch

    if bits not in (2, 4, 8):
        raise _refuse("qweight", f"{bits}-bit GPTQ packs values across int32 words; only 2, 4 and 8 bits are read")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise _refuse("qweight", "qweight and qzeros must be int32")
    q = _unpack_rows(qweight, bits)
    rows = in_features if in_features is not None else q.shape[0]
    q = q[:rows]
    out_features = scales.shape[-1]
    z = _unpack_cols(qzeros, bits)[:, :out_features] + zero_offset
    if q.shape[1] != out_features or z.shape[0] != scales.shape[0]:
        raise _refuse("qweight", f"qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and scales {list(scales.shape)} disagree")
    if g_idx is None:
        g_idx = torch.arange(rows, dtype=torch.int32) // group_size
    g = g_idx.to(torch.long)
    if g.numel() != rows or (g.numel() and (int(g.min()) < 0 or int(g.max()) >= scales.shape[0])):
        raise _refuse("g_idx", f"g_idx of {g.numel()} entries does not index {scales.shape[0]} groups for {rows} rows")
    w = scales[g] * (q - z[g])
    return w.t().contiguous()


def awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int) -> torch.Tensor:
    """AWQ GEMM (AutoAWQ ``dequantize_gemm`` / ``unpack_awq`` + ``reverse_awq_order``): ``qweight`` int32
    ``[in, out/8]`` and ``qzeros`` int32 ``[groups, out/8]`` packed along the output dim in AWQ's
    interleaved order, ``scales`` ``[groups, out]``; ``W = (q - z) * s`` in the scale's dtype, no +1.
    Returns ``[out, in]``."""
    import torch

    if bits != 4:
        raise _refuse("qweight", f"AWQ GEMM packing is read for 4 bits only, not {bits}")
    order = torch.tensor(AWQ_REVERSE)

    def unpack(x: torch.Tensor) -> torch.Tensor:
        v = _unpack_cols(x, 4)
        return v.reshape(*x.shape, 8)[..., order].reshape(*x.shape[:-1], x.shape[-1] * 8)

    q = unpack(qweight)
    z = unpack(qzeros)
    rows, out_features = q.shape
    if scales.shape != (math.ceil(rows / group_size), out_features) or z.shape != scales.shape:
        raise _refuse("qweight", f"qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and scales {list(scales.shape)} disagree")
    g = torch.arange(rows) // group_size
    w = (q - z[g]) * scales[g]
    return w.t().contiguous()


# ------------------------------------------------------------------------------------------ bitsandbytes
def bnb_quant_state(raw: torch.Tensor) -> dict[str, Any]:
    """The JSON that bitsandbytes packs into ``weight.quant_state.bitsandbytes__nf4`` (``pack_dict_to_tensor``)."""
    import torch

    try:
        out = json.loads(bytes(raw.contiguous().view(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse("quant_state", f"the packed quant state is not JSON ({e})") from None
    if not isinstance(out, dict):
        raise _refuse("quant_state", "the packed quant state is not a mapping")
    return out


def bnb_blockwise(values: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' ``dequantize_blockwise`` (default backend): ``code[q] * absmax[block]`` in float32,
    the last block possibly short."""
    import torch

    flat = code.to(torch.float32)[values.reshape(-1).to(torch.int64)]
    n = flat.numel()
    blocks = math.ceil(n / blocksize)
    if absmax.numel() != blocks:
        raise _refuse("absmax", f"{absmax.numel()} absmax values for {blocks} blocks of {blocksize}")
    a = absmax.to(torch.float32).reshape(-1)
    full = n - n % blocksize
    out = torch.empty(n, dtype=torch.float32)
    out[:full] = (flat[:full].reshape(-1, blocksize) * a[: full // blocksize].reshape(-1, 1)).reshape(-1)
    if full < n:
        out[full:] = flat[full:] * a[-1]
    return out


def bnb_4bit(
    data: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    state: Mapping[str, Any],
    *,
    nested_absmax: torch.Tensor | None = None,
    nested_quant_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """bitsandbytes 4-bit (``functional.dequantize_4bit``, default backend ``_dequantize_4bit_compute``):
    two codes per byte, the first in the high nibble, ``quant_map[code] * absmax[block]`` in float32, cast
    to the quant state's dtype. A double-quantized (nested) absmax is itself uint8 codes dequantized
    blockwise with ``nested_absmax`` / ``nested_quant_map``, plus ``nested_offset``."""
    import torch

    blocksize = state.get("blocksize")
    shape = state.get("shape")
    dtype = state.get("dtype")
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise _refuse("weight", f"bitsandbytes blocksize {blocksize!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _refuse("weight", f"bitsandbytes quant state shape {shape!r}")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise _refuse("weight", f"bitsandbytes quant state dtype {dtype!r}")
    if quant_map.numel() != 16:
        raise _refuse("quant_map", f"a 4-bit quant_map has {quant_map.numel()} entries, not 16")
    if nested_absmax is not None:
        if nested_quant_map is None or "nested_offset" not in state or "nested_blocksize" not in state:
            raise _refuse("absmax", "a nested absmax without its nested quant map, blocksize or offset")
        absmax = bnb_blockwise(absmax, nested_absmax, nested_quant_map, int(state["nested_blocksize"]))
        absmax += torch.tensor(float(state["nested_offset"]))
    n = math.prod(shape)
    u8 = data.contiguous().view(torch.uint8).reshape(-1)
    if u8.numel() * 2 < n:
        raise _refuse("weight", f"{u8.numel()} packed bytes cannot hold {n} 4-bit values")
    codes = torch.empty(u8.numel() * 2, dtype=torch.int64)
    codes[0::2] = (u8 >> 4).to(torch.int64)
    codes[1::2] = (u8 & 0x0F).to(torch.int64)
    out = bnb_blockwise(codes[:n], absmax, quant_map, int(blocksize))
    return out.reshape(shape).to(getattr(torch, dtype))


def bnb_int8(weight: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """bitsandbytes LLM.int8 (``int8_vectorwise_dequant``, its default kernel): ``weight * SCB[row] * (1/127)``,
    as bitsandbytes writes it (its constant, not a division), in the SCB's dtype: torch promotes the int8 weight to
    it, and a bfloat16 SCB rounds both products to bfloat16."""
    import torch

    if weight.dtype != torch.int8 or scb.numel() != weight.shape[0]:
        raise _refuse("weight", f"int8 weight {list(weight.shape)} with SCB of {scb.numel()} values")
    if not scb.is_floating_point():
        raise _refuse("SCB", f"an SCB of {str(scb.dtype).removeprefix('torch.')}")
    return weight * scb.view(-1, 1) * 7.874015718698502e-3


# ------------------------------------------------------------------------------------------------- GGUF
def gguf_tensor(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> torch.Tensor:
    """A GGUF tensor's bytes dequantized by the ``gguf`` package's ``quants.dequantize`` (llama.cpp's own
    Python reference) to float32, in the logical ``shape`` (numpy order: ggml's dims reversed)."""
    try:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        raise ConversionError("dequantizing GGUF needs the gguf package: pip install 'dtypeaudit[gguf]'") from None
    import torch

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise _refuse("gguf tensor", f"unknown ggml type {ggml_type}") from None
    data = np.frombuffer(raw.contiguous().view(torch.uint8).numpy().tobytes(), dtype=np.uint8)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    try:
        out = dequantize(data.reshape(rows, -1), qtype)
    except NotImplementedError:
        raise _refuse("gguf tensor", f"the gguf package cannot dequantize {qtype.name}") from None
    except ValueError as e:
        raise _refuse("gguf tensor", f"{qtype.name} bytes do not fit shape {list(shape)} ({e})") from None
    result = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
    if result.numel() != math.prod(shape):
        raise _refuse("gguf tensor", f"{qtype.name} data gives {result.numel()} values, shape {list(shape)} needs {math.prod(shape)}")
    return result.reshape(tuple(shape))


# ---------------------------------------------------------------------------------------------- dispatch
def _need(weight: qm.LogicalWeight, tensors: Mapping[str, torch.Tensor], *roles: str) -> list[torch.Tensor]:
    missing = [r for r in roles if r not in tensors]
    if missing:
        raise ConversionError(f"'{weight.name}' ({weight.scheme.name}) lacks its {', '.join(missing)}; refused")
    return [tensors[r] for r in roles]


def deepseek_block(weight: qm.LogicalWeight) -> tuple[int, int] | None:
    """The config's ``weight_block_size`` where DeepSeek's reference (``weight_dequant`` in DeepSeek-V3's
    ``inference/kernel.py``: block (i, j) times ``scale[i, j]``, the grid ceil-divided, partial edge blocks at the
    bottom and right) reads this FP8 weight's scale grid with it; None where it cannot (no config block, another grid)."""
    p = weight.scheme.params
    cb, grid = p.get("config_block"), p.get("grid")
    if weight.scheme.family != qm.FP8 or not isinstance(cb, tuple) or not isinstance(grid, tuple):
        return None
    if weight.shape is None or len(weight.shape) < 2:
        return None
    rows, cols = weight.shape[-2:]
    return (cb[0], cb[1]) if grid == (-(-rows // cb[0]), -(-cols // cb[1])) else None


def loader_refusal(weight: qm.LogicalWeight, follow: str | None = None) -> str | None:
    """Why a weight is not dequantized, in one line, or None (``group.loader_reading``): from_pretrained fails on
    it, or (FP8) DeepSeek's reference and transformers' read it differently and ``follow`` (``convert
    --fp8-reference``: "transformers", "deepseek", None) does not say which to follow (which is not ours to guess)."""
    from .group import loader_reading

    reading = loader_reading(weight)
    if reading is None:
        return None
    kind, text = reading
    deepseek = deepseek_block(weight)
    if follow == "deepseek" and weight.scheme.family == qm.FP8:
        if deepseek is not None:
            return None
        if kind == "config":  # from_pretrained reads it; DeepSeek's kernel would read its scales at other places
            return f"{text}: refused with --fp8-reference deepseek (DeepSeek's reference reads the config's blocks, not this grid)"
        return f"{text}: refused (DeepSeek's reference cannot read it either)"
    if kind == "config":
        return None
    if kind == "differ":
        if follow == "transformers":
            return None
        lb = weight.scheme.params.get("loader_block")
        assert isinstance(lb, tuple)
        return (
            f"{text}: refused (say which to follow: --fp8-reference transformers or --fp8-reference deepseek; "
            f"or set quantization_config.weight_block_size to [{lb[0]}, {lb[1]}])"
        )
    if deepseek is not None:  # from_pretrained cannot load it, DeepSeek's reference reads it
        return f"{text}: refused (to follow DeepSeek's reference, give --fp8-reference deepseek)"
    return f"{text}: refused"


def fp8_block_of(weight: qm.LogicalWeight, follow: str | None = None) -> tuple[int, ...] | None:
    """The block an FP8 weight is dequantized with: DeepSeek's (the config's, :func:`deepseek_block`) where
    ``follow`` is "deepseek" and the readings part, else the scheme's (the loader's, where it loads)."""
    from .group import loader_reading

    if follow == "deepseek" and loader_reading(weight) is not None:
        block = deepseek_block(weight)
        if block is not None:
            return block
    return _group(weight)


def _group(weight: qm.LogicalWeight) -> tuple[int, ...] | None:
    return tuple(weight.scheme.group) if weight.scheme.group else None


def dequantize(weight: qm.LogicalWeight, tensors: Mapping[str, torch.Tensor], follow: str | None = None) -> torch.Tensor:
    """The logical weight from its storage tensors (role -> tensor, the roles of ``weight.storage``), in its
    natural dtype; ``ConversionError`` where the scheme or its parameters cannot be dequantized exactly.
    ``follow``: the FP8 reference where transformers' and DeepSeek's part (:func:`loader_refusal`)."""
    s = weight.scheme
    p = s.params
    fam = s.family
    try:
        return _dispatch(weight, tensors, s, p, fam, follow)
    except (RuntimeError, IndexError, ValueError) as e:  # shapes the checks above did not foresee
        raise ConversionError(f"cannot dequantize '{weight.name}' ({s.name}): {e}; refused") from None


def _dispatch(
    weight: qm.LogicalWeight, tensors: Mapping[str, torch.Tensor], s: qm.QuantScheme, p: Mapping[str, object], fam: str, follow: str | None
) -> torch.Tensor:
    if weight.missing:
        raise ConversionError(f"'{weight.name}' ({s.name}) lacks its {', '.join(weight.missing)}; refused")
    if fam == qm.FP8:
        w = _need(weight, tensors, "weight", *(("scale",) if "scale" in weight.storage else ()))[0]
        refused = loader_refusal(weight, follow)
        if refused:
            raise ConversionError(refused)
        block = fp8_block_of(weight, follow)
        return fp8_block(w, tensors.get("scale"), block if block and len(block) == 2 else None)
    if fam == qm.COMPRESSED:
        w, sc = _need(weight, tensors, "weight", "scale")
        if "g_idx" in tensors:
            raise _refuse(weight.name, "activation-ordered (g_idx) compressed-tensors weights are not read")
        return compressed(w, sc, tensors.get("zero"), strategy=str(p.get("strategy", "")), group=_group(weight))
    if fam == qm.PACKED:
        w, sc = _need(weight, tensors, "packed", "scale")
        if "g_idx" in tensors:
            raise _refuse(weight.name, "activation-ordered (g_idx) compressed-tensors weights are not read")
        shape = [int(x) for x in tensors["shape"].tolist()] if "shape" in tensors else list(weight.shape or ())
        return packed(w, sc, tensors.get("zero"), shape=shape, bits=s.bits, strategy=str(p.get("strategy", "")), group=_group(weight))
    if fam == qm.NVFP4:
        w, sc, gs = _need(weight, tensors, "packed", "scale", "global_scale")
        group = _group(weight)
        return nvfp4(w, sc, gs, group=group[-1] if group else 16)
    if fam == qm.MXFP4:
        b, sc = _need(weight, tensors, "blocks", "scale")
        return mxfp4(b, sc)
    if fam == qm.GPTQ:
        q, z, sc = _need(weight, tensors, "qweight", "zero", "scale")
        group = _group(weight)
        gsize = group[-1] if group and group[-1] > 0 else q.shape[0] * (32 // s.bits)
        offset = 0 if str(p.get("checkpoint_format", "gptq")) == "gptq_v2" else 1
        rows = weight.shape[-1] if weight.shape else None
        return gptq(q, z, sc, tensors.get("g_idx"), bits=s.bits, group_size=gsize, in_features=rows, zero_offset=offset)
    if fam == qm.AWQ:
        q, z, sc = _need(weight, tensors, "qweight", "zero", "scale")
        if str(p.get("version", "gemm")).lower() != "gemm":
            raise _refuse(weight.name, f"AWQ version '{p.get('version')}' packs differently; only GEMM is read")
        group = _group(weight)
        gsize = group[-1] if group and group[-1] > 0 else q.shape[0]
        return awq(q, z, sc, bits=s.bits, group_size=gsize)
    if fam == qm.BNB4:
        w, am, qmap, st = _need(weight, tensors, "weight", "absmax", "quant_map", "quant_state")
        state = bnb_quant_state(st)
        nested = "nested_absmax" in tensors
        return bnb_4bit(
            w,
            am,
            qmap,
            state,
            nested_absmax=tensors.get("nested_absmax") if nested else None,
            nested_quant_map=tensors.get("nested_quant_map"),
        )
    if fam == qm.BNB8:
        w, sc = _need(weight, tensors, "weight", "scale")
        return bnb_int8(w, sc)
    if fam == qm.GGUF:
        (w,) = _need(weight, tensors, "weight")
        ggml = p.get("ggml_type")
        if not isinstance(ggml, int) or weight.shape is None:
            raise _refuse(weight.name, "a GGUF tensor without its ggml type or shape")
        return gguf_tensor(w, ggml, weight.shape)
    raise ConversionError(f"'{weight.name}': no dequantizer for the {fam} family ({s.name}); refused")
