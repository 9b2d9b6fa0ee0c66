"""Each dequantizer against the reference dequantizer, on data the real writer made where one runs on CPU.

References: transformers' FP8 (``Fp8Quantize`` writes, ``Fp8Dequantize`` / ``_dequantize_fp8_weight`` read) and
MXFP4 (``convert_moe_packed_tensors``); compressed-tensors' compressors (``compress`` writes, ``decompress``
reads); bitsandbytes' CPU ``quantize_4bit`` / ``dequantize_4bit`` and ``int8_vectorwise_*``; gguf's
``quants.quantize`` / ``quants.dequantize``. All comparisons are bit-equal (``torch.equal``) because each
dequantizer computes in its reference's order; where a test says otherwise it states the tolerance.
GPTQ and AWQ: neither gptqmodel nor AutoAWQ installs on this CPU-only machine (both build CUDA kernels), so
those tests pack the documented layout themselves (a packer written here from the formats' documentation,
independent of the dequantizer) and compare with the formula on the unpacked integers.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from dtypeaudit.errors import ConversionError
from dtypeaudit.quant import dequant as dq
from dtypeaudit.quant import model as qm

# --------------------------------------------------------------------------------------------------- FP8


def _fp8_writer(block: list[int] | None) -> object:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = SimpleNamespace(weight_block_size=block, scale_fmt=None)
    return Fp8Quantize(SimpleNamespace(quantization_config=config))


@pytest.mark.parametrize("shape", [(256, 384), (4, 256, 128)])
def test_fp8_block_matches_transformers(shape: tuple[int, ...]) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = torch.randn(*shape, dtype=torch.bfloat16) * 0.05
    out = _fp8_writer([128, 128])._quantize_one("layer.weight", w)  # type: ignore[attr-defined]
    q, s = out["layer.weight"], out["layer.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
    reference = Fp8Dequantize(None)
    mine = dq.fp8_block(q, s, (128, 128))
    assert mine.dtype == torch.float32
    assert torch.equal(mine, reference._dequantize_one(q, s, output_dtype=torch.float32))
    # the loader's bf16 weight is the float32 product rounded once, as convert's cast does
    assert torch.equal(mine.to(torch.bfloat16), reference._dequantize_one(q, s, output_dtype=torch.bfloat16))
    # the writer's own error: e4m3 keeps 3 mantissa bits, half an ulp is 1/16 of the block's largest value
    assert (mine - w.float()).abs().max() <= w.float().abs().max() / 16


def test_fp8_partial_edge_blocks_match_transformers() -> None:
    """DeepSeek-V3 shapes that 128 does not divide: the last row/column blocks are partial. transformers'
    per-layer dequantizer refuses those shapes; its backward-pass ``_dequantize_fp8_weight`` covers them."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(1)
    q = (torch.randn(200, 300) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.01
    mine = dq.fp8_block(q, s, (128, 128))
    assert torch.equal(mine, _dequantize_fp8_weight(q, s, [128, 128], torch.float32))
    # spot-check the block rule itself: element (150, 290) uses scale (1, 2)
    assert mine[150, 290] == q[150, 290].float() * s[1, 2]


@pytest.mark.parametrize("target", ["bfloat16", "float16", "float32"])
def test_fp8_block_by_table_equals_the_products(target: str) -> None:
    """convert's fast path (one lookup per code in a per-block table of results) against the element-wise
    products: every one of the 256 codes (NaN, +-0, subnormals), partial edge blocks, tiny and huge scales."""
    g = torch.Generator().manual_seed(13)
    q = torch.randint(0, 256, (300, 260), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=g) * 1e-3
    s[0, 0], s[2, 2] = 1e-30, 300.0  # results that underflow float16 and that overflow it
    want = dq.fp8_block(q, s, (128, 128)).to(getattr(torch, target))
    got = dq.fp8_block_cast(q, s, (128, 128), target)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


@pytest.mark.parametrize("fp8", FLOAT8)
def test_float8_values_are_torchs_bit_for_bit(fp8: str) -> None:
    """The numpy table of the 256 codes (what lets convert dequantize FP8 without torch) against torch's own
    float8 -> float32 conversion, compared as bits: zeros' signs, subnormals, inf, and each NaN's bits."""
    import numpy as np

    ours = dq.float8_values(fp8)
    theirs = torch.arange(256, dtype=torch.uint8).view(getattr(torch, fp8)).to(torch.float32).numpy()
    assert ours.dtype == np.float32 and ours.shape == (256,)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.isnan(ours).sum() == {"float8_e4m3fn": 2, "float8_e5m2": 6}.get(fp8, 1)


@pytest.mark.parametrize("target", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("fp8", FLOAT8)
def test_fp8_block_cast_np_equals_the_products_cast_by_torch(fp8: str, target: str) -> None:
    """The numpy path convert takes, for every float8 format: the 256 codes in every block, partial edge blocks,
    scales that underflow and overflow float16; bit-equal to torch's products cast by torch, and the count of
    values a float16 target turned infinite is exactly torch's."""
    import numpy as np

    g = torch.Generator().manual_seed(17)
    codes = torch.randint(0, 256, (300, 260), dtype=torch.uint8, generator=g)
    s = torch.rand(3, 3, generator=g) * 1e-2
    s[0, 0], s[1, 2], s[2, 2] = 1e-30, 1e4, 300.0
    products = dq.fp8_block(codes.view(getattr(torch, fp8)), s, (128, 128))
    want = products.to(getattr(torch, target))
    got, looked = dq.fp8_block_cast_np(codes.numpy(), s.numpy(), fp8, (128, 128), target)
    assert got.dtype == {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[target]
    assert np.array_equal(got.view(np.uint8), want.view(torch.uint8).numpy())
    # NaN codes and products beyond float16: the products come back for the value checks, bit-equal to torch's
    assert looked is not None and np.array_equal(looked.view(np.uint32), products.view(torch.int32).numpy().view(np.uint32))
    clamped, _ = dq.fp8_block_cast_np(codes.numpy(), s.numpy(), fp8, (128, 128), target, clamp=True)
    if target == "float16":
        top = torch.finfo(torch.float16).max
        assert np.array_equal(clamped.view(np.uint8), products.clamp(-top, top).to(torch.float16).view(torch.uint8).numpy())


@pytest.mark.parametrize("fp8", FLOAT8)
def test_fp8_special_codes_are_exactly_the_nonfinite_ones(fp8: str) -> None:
    """The bit test that finds NaN/Inf codes without a lookup picks exactly the codes whose value is not finite."""
    import numpy as np

    mask, bits = dq.SPECIAL_CODES[fp8]
    codes = np.arange(256)
    assert np.array_equal((codes & mask) == bits, ~np.isfinite(dq.float8_values(fp8)))


def test_fp8_plain_pieces_skip_the_second_pass() -> None:
    """Finite codes whose products bfloat16 holds: nothing for the checks (None); one NaN code: the products."""
    import numpy as np

    codes = np.full((4, 4), 0x38, dtype=np.uint8)  # 1.0 in e4m3fn
    scale = np.ones((1, 1), dtype=np.float32)
    out, looked = dq.fp8_block_cast_np(codes, scale, "float8_e4m3fn", (128, 128), "bfloat16")
    assert looked is None and np.array_equal(out, np.full((4, 4), 0x3F80, dtype=np.uint16))
    codes[2, 3] = 0x7F
    _, looked = dq.fp8_block_cast_np(codes, scale, "float8_e4m3fn", (128, 128), "bfloat16")
    assert looked is not None and int(np.isnan(looked).sum()) == 1


def test_ordered_keeps_order_and_bounds_the_bytes_in_flight() -> None:
    """convert's pipeline: results in the tasks' order, and the results computed and not yet consumed never
    hold more than the budget plus one task's (each task says what its result holds)."""
    import threading
    import time

    from dtypeaudit.pieces import ordered

    lock = threading.Lock()
    held, worst = [0], [0]

    def task(i: int) -> int:
        time.sleep(0.001 * (i % 3))  # finish out of order
        return i

    def tasks():  # type: ignore[no-untyped-def]
        for i in range(60):
            cost = 50 if i % 10 == 0 else 5  # now and then a large result
            with lock:
                held[0] += cost
                worst[0] = max(worst[0], held[0])
            yield (lambda i=i: task(i)), cost

    out = []
    for i in ordered(tasks(), 3, budget=20):
        out.append(i)
        with lock:
            held[0] -= 50 if i % 10 == 0 else 5
    assert out == list(range(60))
    assert worst[0] <= 20 + 50
    assert list(ordered(iter([((lambda: 7), 1)]), 1, budget=0)) == [7]


def test_fp8_per_tensor_and_bad_scale_shape() -> None:
    q = (torch.randn(8, 16) * 10).to(torch.float8_e4m3fn)
    s = torch.tensor([0.5])
    assert torch.equal(dq.fp8_block(q, s, None), q.float() * 0.5)
    with pytest.raises(ConversionError, match=r"weight_scale_inv has shape \[1, 2\].*need \[1, 1\]"):
        dq.fp8_block(q, torch.ones(1, 2), (128, 128))


# ------------------------------------------------------------------------------------ compressed-tensors


def _ct(fmt: str, weight: torch.Tensor, **args: object) -> tuple[dict[str, torch.Tensor], object, object]:
    """compressed-tensors' own compressor writes the per-module state dict; returns it, the scheme, the compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    qargs = QuantizationArgs(**args)  # type: ignore[arg-type]
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    x = weight.float()
    global_scale = None
    if qargs.strategy == "tensor":
        lo, hi = x.amin().reshape(1), x.amax().reshape(1)
    elif qargs.strategy == "channel":
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    elif qargs.strategy in ("group", "tensor_group"):
        g = x.unflatten(-1, (-1, qargs.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
        if qargs.strategy == "tensor_group":
            global_scale = generate_gparam(x.amin(), x.amax())
    else:  # block
        bm, bn = qargs.block_structure
        r, c = math.ceil(x.shape[0] / bm), math.ceil(x.shape[1] / bn)
        padded = torch.nn.functional.pad(x, (0, c * bn - x.shape[1], 0, r * bm - x.shape[0]))
        blocks = padded.reshape(r, bm, c, bn)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(lo.to(weight.dtype), hi.to(weight.dtype), qargs, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    compressor = BaseCompressor.load_from_registry(fmt)
    return compressor.compress(state, scheme), scheme, compressor


@pytest.mark.parametrize(
    ("bits", "symmetric", "strategy", "group_size"),
    [(4, True, "group", 32), (4, False, "group", 64), (8, True, "channel", None), (4, False, "channel", None), (8, False, "group", 128)],
)
def test_pack_quantized_matches_compressed_tensors(bits: int, symmetric: bool, strategy: str, group_size: int | None) -> None:
    torch.manual_seed(bits + int(symmetric))
    w = torch.randn(48, 256, dtype=torch.bfloat16)
    sd, scheme, comp = _ct("pack-quantized", w, num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    assert sd["weight_packed"].dtype == torch.int32 and sd["weight_packed"].shape == (48, 256 * bits // 32)
    assert ("weight_zero_point" in sd) == (not symmetric)
    reference = comp.decompress(dict(sd), scheme)["weight"]  # type: ignore[attr-defined]
    group = (group_size,) if group_size else (-1,)
    mine = dq.packed(
        sd["weight_packed"],
        sd["weight_scale"],
        sd.get("weight_zero_point"),
        shape=sd["weight_shape"].tolist(),
        bits=bits,
        strategy=strategy,
        group=group,
    )
    assert mine.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(mine, reference)


@pytest.mark.parametrize(
    ("fmt", "args"),
    [
        ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}),
        ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}),
        ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}),
        ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
        ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]}),
    ],
)
def test_unpacked_compressed_tensors_match(fmt: str, args: dict[str, object]) -> None:
    torch.manual_seed(3)
    w = torch.randn(200, 320, dtype=torch.bfloat16)  # 200 x 320: partial 128x128 blocks on both edges
    sd, scheme, comp = _ct(fmt, w, **args)
    reference = comp.decompress(dict(sd), scheme)["weight"]  # type: ignore[attr-defined]
    group = tuple(args["block_structure"]) if "block_structure" in args else ((args["group_size"],) if "group_size" in args else None)  # type: ignore[arg-type]
    mine = dq.compressed(sd["weight"], sd["weight_scale"], sd.get("weight_zero_point"), strategy=str(args["strategy"]), group=group)
    assert mine.dtype == reference.dtype
    assert torch.equal(mine, reference)


def test_nvfp4_matches_compressed_tensors() -> None:
    torch.manual_seed(4)
    w = torch.randn(32, 128, dtype=torch.bfloat16)
    sd, scheme, comp = _ct("nvfp4-pack-quantized", w, num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16)
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_scale"].dtype == torch.float8_e4m3fn
    reference = comp.decompress(dict(sd), scheme)["weight"]  # type: ignore[attr-defined]
    mine = dq.nvfp4(sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"], group=16)
    assert torch.equal(mine, reference)


def test_pack_widths_that_straddle_words_are_refused() -> None:
    with pytest.raises(ConversionError, match="3-bit values straddle int32 words"):
        dq.packed(torch.zeros(4, 3, dtype=torch.int32), torch.ones(4, 1), None, shape=[4, 32], bits=3, strategy="channel")


# ----------------------------------------------------------------------------------------------- MXFP4


def test_mxfp4_matches_transformers() -> None:
    """No MXFP4 writer runs on CPU (transformers quantizes through triton_kernels); the layout is random bytes,
    which covers every e2m1 code and the whole usable e8m0 range (scales 100..140 keep bf16 finite)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (2, 64, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 141, (2, 64, 4), dtype=torch.uint8, generator=g)
    mine = dq.mxfp4(blocks, scales)
    assert mine.shape == (2, 128, 64)  # [experts, in (4 blocks of 32), out]: the parameter's layout
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(mine.to(dtype), reference), dtype


# --------------------------------------------------------------------------------------- GPTQ and AWQ


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight packing (AutoGPTQ QuantLinear.pack): rows k*per .. k*per+per-1 into word row k, row
    k*per+i at bit i*bits."""
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= q[i::per].to(torch.int64) << (i * bits)
    return _as_int32(out)


def _pack_cols(z: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Columns j*per .. into word column j; value i at bit i*bits holds column ``order[i]`` of the group."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = torch.zeros(z.shape[0], z.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= z[:, order[i] :: per].to(torch.int64) << (i * bits)
    return _as_int32(out)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) reinterpreted as the int32 the files store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize(("bits", "fmt"), [(4, "gptq"), (4, "gptq_v2"), (8, "gptq"), (2, "gptq_v2")])
def test_gptq_documented_layout(bits: int, fmt: str) -> None:
    g = torch.Generator().manual_seed(bits)
    in_f, out_f, gs = 256, 64, 64
    q = torch.randint(0, 2**bits, (in_f, out_f), generator=g)
    zeros = torch.randint(1, 2**bits, (in_f // gs, out_f), generator=g)
    scales = (torch.rand(in_f // gs, out_f, generator=g) * 0.02 + 0.001).half()
    stored = zeros - 1 if fmt == "gptq" else zeros  # the original format stores zero - 1
    mine = dq.gptq(
        _pack_rows(q, bits), _pack_cols(stored, bits), scales, None, bits=bits, group_size=gs, zero_offset=1 if fmt == "gptq" else 0
    )
    groups = torch.arange(in_f) // gs
    expected = (scales[groups] * (q - zeros[groups])).t()
    assert mine.dtype == torch.float16 and mine.shape == (out_f, in_f)
    assert torch.equal(mine, expected)


def test_gptq_act_order_g_idx() -> None:
    """desc_act: g_idx maps each input row to its group in any order."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (128, 32), generator=g)
    zeros = torch.randint(1, 16, (4, 32), generator=g)
    scales = torch.rand(4, 32, generator=g).half()
    g_idx = (torch.arange(128) // 32)[torch.randperm(128, generator=g)].to(torch.int32)
    mine = dq.gptq(_pack_rows(q, 4), _pack_cols(zeros - 1, 4), scales, g_idx, bits=4, group_size=32)
    gl = g_idx.long()
    assert torch.equal(mine, (scales[gl] * (q - zeros[gl])).t())
    with pytest.raises(ConversionError, match="g_idx of 127 entries"):
        dq.gptq(_pack_rows(q, 4), _pack_cols(zeros - 1, 4), scales, g_idx[:127], bits=4, group_size=32)
    with pytest.raises(ConversionError, match="3-bit GPTQ"):
        dq.gptq(_pack_rows(q, 4), _pack_cols(zeros - 1, 4), scales, None, bits=3, group_size=32)


def test_awq_interleaved_order() -> None:
    """AutoAWQ packs output columns 0,2,4,6,1,3,5,7 into nibbles 0..7 (AWQ_ORDER); reading them in GPTQ's
    plain order would permute every weight, which the last assertion shows the test would catch."""
    g = torch.Generator().manual_seed(11)
    in_f, out_f, gs = 128, 64, 32
    q = torch.randint(0, 16, (in_f, out_f), generator=g)
    zeros = torch.randint(0, 16, (in_f // gs, out_f), generator=g)
    scales = torch.rand(in_f // gs, out_f, generator=g).half()
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    mine = dq.awq(_pack_cols(q, 4, order), _pack_cols(zeros, 4, order), scales, bits=4, group_size=gs)
    groups = torch.arange(in_f) // gs
    expected = ((q - zeros[groups]) * scales[groups]).t()
    assert torch.equal(mine, expected)
    plain = dq.awq(_pack_cols(q, 4), _pack_cols(zeros, 4), scales, bits=4, group_size=gs)
    assert not torch.equal(plain, expected)


# --------------------------------------------------------------------------------------- bitsandbytes


@pytest.mark.parametrize(
    ("quant_type", "nested", "blocksize"), [("nf4", False, 64), ("nf4", True, 64), ("fp4", True, 128), ("fp4", False, 64)]
)
def test_bnb_4bit_matches_bitsandbytes(quant_type: str, nested: bool, blocksize: int) -> None:
    import bitsandbytes.functional as F

    torch.manual_seed(7)
    w = torch.randn(96, 200, dtype=torch.bfloat16)  # 19200 values: not a multiple of 128 blocks -> short last block
    data, state = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    saved = state.as_dict(packed=True)  # the tensors save_pretrained writes beside weight
    reference = F.dequantize_4bit(data, F.QuantState.from_dict(dict(saved), torch.device("cpu")))
    packed_state = saved[f"quant_state.bitsandbytes__{quant_type}"]
    info = dq.bnb_quant_state(packed_state)
    assert info["quant_type"] == quant_type and info["shape"] == [96, 200]
    mine = dq.bnb_4bit(
        data,
        saved["absmax"],
        saved["quant_map"],
        info,
        nested_absmax=saved.get("nested_absmax"),
        nested_quant_map=saved.get("nested_quant_map"),
    )
    assert saved["absmax"].dtype == (torch.uint8 if nested else torch.float32)
    assert mine.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(mine, reference)


def test_bnb_int8_matches_bitsandbytes() -> None:
    import bitsandbytes.functional as F

    torch.manual_seed(8)
    w = torch.randn(64, 96, dtype=torch.float16)
    q, scb, _ = F.int8_vectorwise_quant(w)
    assert torch.equal(dq.bnb_int8(q, scb), F.int8_vectorwise_dequant(q, scb))


def test_bnb_refuses_an_unknown_blocksize() -> None:
    state = {"blocksize": 48, "shape": [2, 48], "dtype": "float16", "quant_type": "nf4"}
    with pytest.raises(ConversionError, match="bitsandbytes blocksize 48"):
        dq.bnb_4bit(torch.zeros(48, dtype=torch.uint8), torch.ones(2), torch.zeros(16), state)


# ------------------------------------------------------------------------------------------------ GGUF


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_1", "Q6_K", "BF16", "F16", "F32"])
def test_gguf_matches_gguf_package(name: str) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(12)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    try:
        data = quantize(x, qtype)
    except NotImplementedError:  # gguf's Python side only dequantizes some K-quants: random blocks then
        assert name == "Q6_K"
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (8, 512 // block * size), dtype=np.uint8)
        d = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        data[..., size - 2 :: size], data[..., size - 1 :: size] = d  # each block's fp16 scale d: finite
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
    mine = dq.gguf_tensor(raw, int(qtype), (8, 512))
    reference = torch.from_numpy(dequantize(np.ascontiguousarray(data).view(np.uint8).reshape(8, -1), qtype).astype(np.float32))
    assert torch.equal(mine, reference)
    if name != "Q6_K":
        assert (mine - torch.from_numpy(x)).abs().max() < {"Q4_0": 0.6, "Q5_1": 0.3}.get(name, 0.05)


# -------------------------------------------------------------------------------------------- dispatch


def _weight(scheme: qm.QuantScheme, roles: dict[str, str], shape: tuple[int, ...] | None, **kw: object) -> qm.LogicalWeight:
    return qm.LogicalWeight("m.weight", "m", scheme, roles, shape, "bfloat16", 4.0, **kw)  # type: ignore[arg-type]


def test_dispatch_refuses_missing_roles_and_unknown_families() -> None:
    scheme = qm.QuantScheme("fp8-e4m3 block 128x128", qm.FP8, "float8_e4m3fn", 8, (128, 128))
    w = _weight(scheme, {"weight": "m.weight", "scale": "m.weight_scale_inv"}, (8, 8))
    with pytest.raises(ConversionError, match=r"'m.weight' \(fp8-e4m3 block 128x128\) lacks its scale; refused"):
        dq.dequantize(w, {"weight": torch.zeros(8, 8, dtype=torch.float8_e4m3fn)})
    missing = _weight(scheme, {"weight": "m.weight"}, (8, 8), missing=("scale",))
    with pytest.raises(ConversionError, match="lacks its scale"):
        dq.dequantize(missing, {"weight": torch.zeros(8, 8, dtype=torch.float8_e4m3fn)})
    odd = _weight(qm.QuantScheme("int4 marlin", "marlin", "int4", 4), {"weight": "m.weight"}, None)
    with pytest.raises(ConversionError, match="no dequantizer for the marlin family"):
        dq.dequantize(odd, {"weight": torch.zeros(1)})


def test_dispatch_bnb_from_saved_roles() -> None:
    import bitsandbytes.functional as F

    w = torch.randn(16, 64, dtype=torch.float16)
    data, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    saved = state.as_dict(packed=True)
    scheme = qm.QuantScheme("nf4 blocksize 64", qm.BNB4, "nf4", 4, (64,), params={"quant_type": "nf4", "nested": True})
    roles = {"weight": "w", "absmax": "a", "quant_map": "m", "quant_state": "s", "nested_absmax": "na", "nested_quant_map": "nm"}
    tensors = {
        "weight": data,
        "absmax": saved["absmax"],
        "quant_map": saved["quant_map"],
        "quant_state": saved["quant_state.bitsandbytes__nf4"],
        "nested_absmax": saved["nested_absmax"],
        "nested_quant_map": saved["nested_quant_map"],
    }
    out = dq.dequantize(_weight(scheme, roles, (16, 64)), tensors)
    assert torch.equal(out, F.dequantize_4bit(data, state))
    assert json.loads(bytes(saved["quant_state.bitsandbytes__nf4"].tolist()))["nested_offset"] == pytest.approx(float(state.offset))
