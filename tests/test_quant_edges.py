"""Quantized checkpoints at their edges (issue 31): each class dequantized and listed as its reference loader does
it, or refused with exit 2 and one line.

The references: transformers 5.24 ``from_pretrained`` on CPU (FP8 and MXFP8 dequantize there, ``Fp8Dequantize``),
bitsandbytes' own ``int8_vectorwise_dequant``. The FP8 folders are tiny Llamas written by transformers' own FP8
writer (``Fp8Quantize``, the op its quantizer runs on save) where the block divides the weight, and by its
``FP8Linear`` allocation (``replace_with_fp8_linear``: the DeepSeek-V3 layout, a ceil-divided scale grid) where it
does not, values filled in. Every comparison is bit for bit with what the loader gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtypeaudit.checks import check
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.quant.group import policy_records

from .helpers import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q = "model.layers.0.self_attn.q_proj"


def _llama(hidden: int, inter: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


def _config(model: Any, quantization: dict[str, Any], dtype: str | None = "bfloat16", key: str = "dtype") -> dict[str, Any]:
    config = model.config.to_dict()
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype is not None:
        config[key] = dtype
    config["quantization_config"] = quantization
    return config


def _write(path: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _quantized(hidden: int = 256, inter: int = 384, *, scale_fmt: str = "float") -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny Llama's state with its Linears quantized by transformers' own FP8 writer (128x128 blocks)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    model = _llama(hidden, inter)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    writer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt)))
    for name in [k for k in state if k.endswith(".weight") and any(p in k for p in LINEARS)]:
        state.update(writer._quantize_one(name, state.pop(name)))
    return model, state


def _allocated(hidden: int, inter: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny Llama whose Linears transformers' replace_with_fp8_linear made FP8Linear (the DeepSeek-V3 layout: a
    [ceil(out/128), ceil(in/128)] scale grid, partial edge blocks), values filled in."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = _llama(hidden, inter)
    qc = FineGrainedFP8Config(weight_block_size=[128, 128])
    fp8 = replace_with_fp8_linear(_llama(hidden, inter), modules_to_not_convert=["lm_head"], quantization_config=qc)
    g = torch.Generator().manual_seed(1)
    state = {}
    for k, v in fp8.state_dict().items():
        if v.dtype == torch.float8_e4m3fn:
            state[k] = (torch.randn(v.shape, generator=g) * 40).to(v.dtype)
        elif k.endswith("weight_scale_inv"):
            state[k] = torch.rand(v.shape, generator=g) * 1e-3 + 1e-4
        else:
            state[k] = model.state_dict()[k]
    return model, state


FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu").state_dict()


def _converted(src: Path, out: Path, to: str = "bf16") -> dict[str, torch.Tensor]:
    proc = run_cli("convert", str(src), "--to", to, "-o", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return load_file(out / "model.safetensors")


def _bit_equal(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(mine) == set(reference)
    for k, v in reference.items():
        assert mine[k].dtype == v.dtype and mine[k].shape == v.shape, k
        assert torch.equal(mine[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


def _rules(path: Path) -> list[tuple[str, str, str | None]]:
    return sorted((f.rule, f.severity, f.tensor) for f in check(read_checkpoint(str(path))) if f.rule.startswith("quant-"))


def _refused(src: Path, out: Path, *words: str) -> str:
    proc = run_cli("convert", str(src), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]
    return lines[0]


# -- 1. MXFP8: uint8 E8M0 scales ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_mxfp8_uint8_scales_are_e8m0_exponents_as_from_pretrained_reads_them(tmp_path: Path) -> None:
    """transformers writes ue8m0 scales as float8_e8m0fnu; MXFP8 checkpoints ship those bytes as uint8, which
    Fp8Dequantize reads as 2^(byte - 127). Not a dtype warning: that is the convention."""
    model, state = _quantized(scale_fmt="ue8m0")
    scales = [k for k in state if k.endswith("weight_scale_inv")]
    assert {state[k].dtype for k in scales} == {torch.float8_e8m0fnu}
    as_bytes = {k: (v.view(torch.uint8) if k in scales else v) for k, v in state.items()}
    src = _write(tmp_path / "mxfp8", as_bytes, _config(model, {**FP8_CONFIG, "scale_fmt": "ue8m0"}))
    assert _rules(src) == []
    reference = _loaded(src)
    _bit_equal(_converted(src, tmp_path / "out"), reference)
    # with numpy alone, as any FP8 block checkpoint: the converting process imports no torch
    proc = run_cli("convert", str(src), "--to", "bf16", "-o", str(tmp_path / "np"), process=True, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported and not [m for m in imported if m.split(".")[0] == "torch"]
    _bit_equal(load_file(tmp_path / "np" / "model.safetensors"), reference)
    # the same weights as the float8_e8m0fnu scales give (the writer's own dtype)
    _bit_equal(_converted(_write(tmp_path / "e8m0", state, _config(model, FP8_CONFIG)), tmp_path / "out2"), reference)


def test_e8m0_table_is_the_loaders_exp2() -> None:
    from dtypeaudit.quant import dequant as dq

    codes = torch.arange(256, dtype=torch.uint8)
    want = (codes.to(torch.float32) - 127.0).exp2()
    assert torch.equal(dq.fp8_scale_float32(codes).view(torch.int32), want.view(torch.int32))
    assert torch.equal(torch.from_numpy(dq.e8m0_float32(codes.numpy())).view(torch.int32), want.view(torch.int32))


# -- 2. FP8 blocks: the loader's block comes from the grid ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(4, 4), (1, 1), (2, 4)], ids=["finer", "coarser", "mixed"])
def test_config_block_and_grid_that_disagree_load_as_the_grid_says(tmp_path: Path, grid: tuple[int, int]) -> None:
    """weight_block_size says 128x128, the grid gives other blocks: from_pretrained follows the grid, and so do
    scan (a warning, not an error) and convert (bit-equal)."""
    model, state = _quantized()
    g = torch.Generator().manual_seed(2)
    state[Q + ".weight_scale_inv"] = torch.rand(grid, generator=g) + 0.5
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    assert _rules(src) == [("quant-scale-shape", "warning", Q + ".weight_scale_inv")]
    assert run_cli("scan", str(src)).returncode == 0
    _bit_equal(_converted(src, tmp_path / "out"), _loaded(src))


@pytest.mark.slow
def test_grid_that_does_not_divide_the_weight_is_refused_as_from_pretrained_refuses(tmp_path: Path) -> None:
    """320 rows over a grid of 3 (FP8Linear's ceil grid for 128x128 blocks): from_pretrained raises, DeepSeek's
    reference would read it; scan says both (an error), convert refuses in one line naming the tensor."""
    from transformers import AutoModelForCausalLM

    model, state = _allocated(320, 384)
    assert tuple(state[Q + ".weight_scale_inv"].shape) == (3, 3)
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    found = [f for f in check(read_checkpoint(str(src))) if f.rule == "quant-scale-shape" and f.tensor == Q + ".weight_scale_inv"]
    assert [f.severity for f in found] == ["error"] and "DeepSeek" in found[0].message and "from_pretrained" in found[0].message
    assert run_cli("scan", str(src)).returncode == 1
    _refused(src, tmp_path / "out", "from_pretrained cannot load model.layers.0.", "does not divide")


@pytest.mark.slow
def test_partial_edge_blocks_where_deepseek_and_transformers_disagree(tmp_path: Path) -> None:
    """200x200 with FP8Linear's [2, 2] grid: DeepSeek's reference reads 128-row blocks with a partial edge,
    from_pretrained 100-row blocks. Scan names both; convert refuses with the way through, and follows
    from_pretrained once the config says the grid's block."""
    model, state = _allocated(200, 300)
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    found = [f for f in check(read_checkpoint(str(src))) if f.rule == "quant-scale-shape"]
    assert found and {f.severity for f in found} == {"warning"}
    assert all("DeepSeek" in f.message and "from_pretrained" in f.message for f in found)
    line = _refused(src, tmp_path / "out", "weight_block_size to [100, 100]", "DeepSeek")
    assert Q + ".weight" in line or "model.layers.0" in line
    reference = _loaded(src)  # from_pretrained loads it, with the grid's blocks
    told = _write(tmp_path / "told", state, _config(model, {**FP8_CONFIG, "weight_block_size": [100, 100]}))
    assert _rules(told) == []
    _bit_equal(_converted(told, tmp_path / "out"), reference)


def test_fp8_block_reads_deepseek_partial_edges_as_its_backward_dequantizer() -> None:
    """The dequantizer itself still reads DeepSeek's partial edge blocks exactly (transformers'
    ``_dequantize_fp8_weight``, its backward pass, is that reference)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from dtypeaudit.quant import dequant as dq

    q = (torch.randn(200, 300, generator=torch.Generator().manual_seed(3)) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.01
    assert torch.equal(dq.fp8_block(q, s, (128, 128)), _dequantize_fp8_weight(q, s, [128, 128], torch.float32))


# -- 3. a scale beside an unquantized weight ------------------------------------------------------------------


@pytest.mark.slow
def test_scale_beside_a_bf16_weight_is_applied_as_from_pretrained_applies_it(tmp_path: Path) -> None:
    model, state = _quantized()
    k = "model.layers.0.self_attn.k_proj"
    state[k + ".weight"] = model.state_dict()[k + ".weight"].clone()  # bf16, beside its (stray) scale
    state[k + ".weight_scale_inv"] = torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    records = {t.name: t for t in policy_records(read_checkpoint(str(src)))}
    assert k + ".weight_scale_inv" not in records and records[k + ".weight"].layout == "quantized"
    reference = _loaded(src)
    assert not torch.equal(reference[k + ".weight"], state[k + ".weight"])  # the loader did scale it
    mine = _converted(src, tmp_path / "out")
    assert k + ".weight_scale_inv" not in mine
    _bit_equal(mine, reference)


# -- 4. bitsandbytes int8 with a bf16 SCB ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bnb_int8_computes_in_the_scb_dtype_as_bitsandbytes_does(dtype: torch.dtype) -> None:
    import bitsandbytes.functional as F

    from dtypeaudit.quant import dequant as dq

    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g)
    cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    scb = scb.to(dtype)
    want = F.int8_vectorwise_dequant(cb, scb)
    got = dq.bnb_int8(cb, scb)
    assert got.dtype == want.dtype and torch.equal(got, want)


# -- 5. the dtypes of the loaded model ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "key"), [("float16", "dtype"), ("float32", "torch_dtype"), (None, "dtype")], ids=["fp16", "fp32-torch_dtype", "none"]
)
def test_quantized_folder_lists_the_dtypes_from_pretrained_loads(tmp_path: Path, dtype: str | None, key: str) -> None:
    """The policies' view (the loaded model) of an FP8 folder: each tensor in from_pretrained's state dict dtype,
    dequantized weights and unquantized parts alike."""
    model, state = _quantized()
    # no config dtype: the first floating tensor of the file (names sorted) decides; make it float32
    if dtype is None:
        state["lm_head.weight"] = state["lm_head.weight"].float()
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG, dtype, key))
    reference = _loaded(src)
    from dtypeaudit.checks import as_policies_see_it

    listed = {t.name: t.dtype for t in as_policies_see_it(read_checkpoint(str(src)))}
    assert listed == {k: str(v.dtype).removeprefix("torch.") for k, v in reference.items()}


@pytest.mark.slow
def test_float8_weight_kept_unquantized_loads_and_converts_as_bf16(tmp_path: Path) -> None:
    model, state = _quantized()
    o = "model.layers.0.self_attn.o_proj"
    del state[o + ".weight_scale_inv"]
    src = _write(tmp_path / "fp8", state, _config(model, {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", o]}))
    reference = _loaded(src)
    assert reference[o + ".weight"].dtype == torch.bfloat16
    from dtypeaudit.checks import as_policies_see_it

    listed = {t.name: t.dtype for t in as_policies_see_it(read_checkpoint(str(src)))}
    assert listed[o + ".weight"] == "bfloat16"
    assert _rules(src) == []  # the config keeps it unquantized, and it is: stored in float8, no scale
    _bit_equal(_converted(src, tmp_path / "out"), reference)


@pytest.mark.slow
def test_bnb_int8_folder_with_a_bf16_scb_converts_as_bitsandbytes_dequantizes(tmp_path: Path) -> None:
    """bitsandbytes on CPU is the writer (transformers quantizes on load, save_pretrained serialises Int8Params);
    the SCBs re-saved as bfloat16. Each weight is bitsandbytes' own int8_vectorwise_dequant, in bfloat16."""
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _llama(256, 384).save_pretrained(tmp_path / "bf16")
    int8 = tmp_path / "int8"
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    ).save_pretrained(int8)
    state = load_file(int8 / "model.safetensors")
    scbs = [k for k in state if k.endswith(".SCB")]
    assert scbs and {state[k].dtype for k in scbs} == {torch.float32}
    state = {k: (v.to(torch.bfloat16) if k in scbs else v) for k, v in state.items()}
    save_file(state, int8 / "model.safetensors", metadata={"format": "pt"})
    for to, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        got = _converted(int8, tmp_path / f"out-{to}", to)
        for scb in scbs:
            weight = scb.removesuffix(".SCB") + ".weight"
            want = F.int8_vectorwise_dequant(state[weight], state[scb]).to(dtype)
            assert got[weight].dtype == dtype and torch.equal(got[weight], want), (to, weight)


# -- 5 and 7. MXFP4 (gpt-oss) ---------------------------------------------------------------------------------------


def _gpt_oss_mxfp4(base: Path, *, hidden: int = 128, dtype: str | None = "bfloat16") -> Path:
    """gpt-oss's layout (experts' ``*_blocks`` / ``*_scales``, as test_quant_convert builds it: no MXFP4 writer runs
    on CPU): the blocks cover the parameter's input dim rounded up to 32 (padded where 32 does not divide it)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    torch.manual_seed(0)
    GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base / "bf16")
    g = torch.Generator().manual_seed(1)
    state = {}
    for k, v in load_file(base / "bf16" / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = v.shape  # [E, in, out]; the blocks are [E, out, ceil(in/32), 16]
            groups = -(-rows // 32)
            state[k + "_blocks"] = torch.randint(0, 256, (experts, cols, groups, 16), dtype=torch.uint8, generator=g)
            state[k + "_scales"] = torch.randint(118, 128, (experts, cols, groups), dtype=torch.uint8, generator=g)
        else:
            state[k] = v
    config = json.loads((base / "bf16" / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    quantization = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    return _write(base / "mxfp4", state, {**config, "quantization_config": quantization})


@pytest.mark.slow
def test_mxfp4_blocks_padded_past_the_parameter_are_refused_as_from_pretrained_refuses(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = _gpt_oss_mxfp4(tmp_path, hidden=112)  # gate_up_proj's input dim 112: blocks of 4 x 32 = 128
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    assert ("quant-scale-shape", "error", "model.layers.0.mlp.experts.gate_up_proj_blocks") in _rules(src)
    _refused(src, tmp_path / "out", "model.layers.0.mlp.experts.gate_up_proj", "size mismatch")
    # the unpadded layout loads, and nothing is found
    assert not [r for r in _rules(_gpt_oss_mxfp4(tmp_path / "ok")) if r[1] == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16", None], ids=["fp16", "fp32", "bf16", "none"])
def test_mxfp4_folder_lists_the_dtypes_from_pretrained_loads(tmp_path: Path, dtype: str | None) -> None:
    """float16: gpt-oss keeps its norms in float32 (_keep_in_fp32_modules); no dtype: the first floating tensor.
    The dequantized experts are in the model's dtype too; convert --to bf16 is from_pretrained's load in bf16."""
    from transformers import AutoModelForCausalLM

    from dtypeaudit.checks import as_policies_see_it

    src = _gpt_oss_mxfp4(tmp_path, dtype=dtype)
    reference = _loaded(src)
    listed = {t.name: t.dtype for t in as_policies_see_it(read_checkpoint(str(src)))}
    assert listed == {k: str(v.dtype).removeprefix("torch.") for k, v in reference.items()}
    as_bf16 = AutoModelForCausalLM.from_pretrained(src, device_map="cpu", dtype=torch.bfloat16).state_dict()
    _bit_equal(_converted(src, tmp_path / "out"), {k: v.to(torch.bfloat16) for k, v in as_bf16.items()})


# -- 7. compressed-tensors config groups ----------------------------------------------------------------------------


@pytest.mark.slow
def test_compressed_tensors_second_group_for_every_linear_is_read_as_the_loader_reads_it(tmp_path: Path) -> None:
    """A first config group for the experts (``re:`` targets; none in a dense Llama), the second for ``Linear``,
    which the tensors follow (compressed-tensors' own compressor wrote them): from_pretrained's dequantizing load
    applies the second to every dense module (``get_dense_scheme``), and so does convert. (The first group read
    instead has group size 128 and no zero points: the scales would not fit.)"""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from .test_quant_convert import _ct_dir

    args = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}
    src = _ct_dir(tmp_path, "pack-quantized", args)
    config = json.loads((src / "config.json").read_text())
    (written,) = config["quantization_config"]["config_groups"].values()
    other = {**written, "targets": [r"re:.*mlp\.experts\..*"], "weights": {**written["weights"], "symmetric": True, "group_size": 128}}
    config["quantization_config"]["config_groups"] = {"group_0": other, "group_1": written}
    (src / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(src, device_map="cpu", quantization_config=CompressedTensorsConfig(dequantize=True))
    assert not [r for r in _rules(src) if r[1] == "error"]
    out = tmp_path / "out"
    assert run_cli("convert", str(src), "--to", "bf16", "-o", str(out)).returncode == 0
    _bit_equal(load_file(out / "model.safetensors"), reference.state_dict())


# -- 6. NaN bits ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["transposed", "strided", "column", "rows"])
def test_npcast_nan_bits_in_views_are_torchs(view: str) -> None:
    """A NaN cast to bfloat16: torch's vectorised loop writes 0xFFFF, its scalar loop (a view it cannot walk
    contiguously) 0x7FC0; npcast on the same view's numpy array writes what torch writes for the tensor."""
    import numpy as np

    from dtypeaudit import npcast

    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(6))
    base[1, 2] = base[3, 0] = base[10, 7] = float("nan")
    v = {"transposed": base.t(), "strided": base[:, ::2], "column": base[:, 2], "rows": base[2:40]}[view]
    want = v.to(torch.bfloat16).contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    got = npcast.cast(v.numpy().reshape(-1), "float32", "bfloat16")
    assert np.isnan(v.numpy()).any() and np.array_equal(got, want)


@pytest.mark.slow
def test_int8_weight_beside_a_scale_is_packed_fp4_as_from_pretrained_reads_it(tmp_path: Path) -> None:
    """Fp8Dequantize reads an int8 X.weight beside its X.weight_scale_inv as two fp4 e2m1 values a byte (MoE experts
    shipped as packed FP4): the scan lists the unpacked weight, convert writes what from_pretrained loads."""
    model, state = _quantized()
    g = torch.Generator().manual_seed(7)
    state[Q + ".weight"] = torch.randint(-128, 128, (256, 128), dtype=torch.int8, generator=g)  # [256, 256] unpacked
    state[Q + ".weight_scale_inv"] = torch.rand(2, 2, generator=g) + 0.5
    src = _write(tmp_path / "fp4", state, _config(model, FP8_CONFIG))
    records = {t.name: t for t in policy_records(read_checkpoint(str(src)))}
    assert records[Q + ".weight"].shape == (256, 256) and records[Q + ".weight"].scheme == "fp4-e2m1 block 128x128"
    assert _rules(src) == []
    _bit_equal(_converted(src, tmp_path / "out"), _loaded(src))


# -- 8. float8_e8m0fnu scales where from_pretrained reads the first shard for the model's dtype ---------------------


def _split(path: Path, second: set[str], index_dtype: str | None = None) -> None:
    """The folder's one file as two shards (``second`` in the second), with the index save_pretrained writes."""
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    for k, v in state.items():
        parts[k in second][k] = v
    for part, name in zip(parts, names, strict=True):
        save_file(part, path / name, metadata={"format": "pt"})
    metadata: dict[str, Any] = {"total_size": sum(v.numel() * v.element_size() for v in state.values())}
    if index_dtype is not None:
        metadata["dtype"] = index_dtype
    weight_map = {k: names[k in second] for k in state}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one-file", "scales-in-the-second-shard", "index-dtype"])
def test_e8m0_scales_without_a_config_dtype_load_where_from_pretrained_loads_them(tmp_path: Path, layout: str) -> None:
    """transformers writes ue8m0 scales as float8_e8m0fnu (F8_E8M0). With no dtype in config.json, from_pretrained
    reads the first shard's tensors to choose one (load_state_dict on meta), and fails on a dtype it cannot read:
    scan and convert refuse it, one line, exit 2. Where the scales are in another shard, or the index names the
    dtype, it loads, and so does dtypeaudit (bit-equal)."""
    from transformers import AutoModelForCausalLM

    model, state = _quantized(scale_fmt="ue8m0")
    scales = {k for k in state if k.endswith("weight_scale_inv")}
    assert {state[k].dtype for k in scales} == {torch.float8_e8m0fnu}
    src = _write(tmp_path / "fp8", state, _config(model, {**FP8_CONFIG, "scale_fmt": "ue8m0"}, None))
    if layout != "one-file":
        index_dtype = "bfloat16" if layout == "index-dtype" else None
        _split(src, scales if layout == "scales-in-the-second-shard" else set(state) - scales, index_dtype)
    if layout == "one-file":
        with pytest.raises(ValueError, match="unknown dtype F8_E8M0"):
            AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
        scan = run_cli("scan", str(src))
        assert scan.returncode == 2, scan.stdout + scan.stderr
        (line,) = scan.stderr.strip().splitlines()
        assert "F8_E8M0" in line and "config.json names no dtype" in line and "weight_scale_inv" in line
        _refused(src, tmp_path / "out", "F8_E8M0", "name the model's dtype in config.json")
        return
    reference = _loaded(src)
    from dtypeaudit.checks import as_policies_see_it

    listed = {t.name: t.dtype for t in as_policies_see_it(read_checkpoint(str(src)))}
    assert listed == {k: str(v.dtype).removeprefix("torch.") for k, v in reference.items()}
    assert run_cli("scan", str(src)).returncode == 0
    out = tmp_path / "out"
    assert run_cli("convert", str(src), "--to", "bf16", "-o", str(out)).returncode == 0
    mine: dict[str, torch.Tensor] = {}
    for f in out.glob("*.safetensors"):
        mine.update(load_file(f))
    _bit_equal(mine, reference)


# -- 9. compressed-tensors: the loaded model's dtypes --------------------------------------------------------------


CT_SCHEMES = {
    "int4-asym-g32": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", None], ids=["fp32", "fp16", "none"])
@pytest.mark.parametrize("scheme", sorted(CT_SCHEMES))
def test_compressed_tensors_folder_lists_the_dtypes_from_pretrained_loads(tmp_path: Path, scheme: str, dtype: str | None) -> None:
    """compressed-tensors' own compressor writes the Linears; from_pretrained's dequantizing load
    (``CompressedTensorsDequantize``) builds the model in the config's dtype (else the first shard's), casts the
    unquantized parts to it and dequantizes into it. The policies' view lists that model, names included (the
    storage names are no unexpected keys and fill the Linears' weights: nothing is found); convert --to bf16 is
    from_pretrained's load in bf16, bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from dtypeaudit.checks import as_policies_see_it

    from .test_quant_convert import _ct_dir

    fmt, args = CT_SCHEMES[scheme]
    src = _ct_dir(tmp_path, fmt, args)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    (src / "config.json").write_text(json.dumps(config))

    def load(**kw: Any) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            src, device_map="cpu", quantization_config=CompressedTensorsConfig(dequantize=True), output_loading_info=True, **kw
        )

    reference, info = load()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    inv = read_checkpoint(str(src))
    listed = {t.name: t.dtype for t in as_policies_see_it(inv)}
    assert listed == {k: str(v.dtype).removeprefix("torch.") for k, v in reference.state_dict().items()}
    assert not [f for f in check(inv) if f.rule.startswith("load-names")]
    as_bf16, _ = load(dtype=torch.bfloat16)
    _bit_equal(_converted(src, tmp_path / "out"), as_bf16.state_dict())


# -- 10. bitsandbytes: the dtype model.dequantize() gives ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", None, "index"], ids=["fp32", "none", "index-fp32"])
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_bnb_folder_lists_the_dtypes_model_dequantize_gives(tmp_path: Path, kind: str, dtype: str | None) -> None:
    """bitsandbytes on CPU writes the folder (quantized on load, save_pretrained). ``model.dequantize()`` casts each
    weight to ``model.config.dtype``, the dtype from_pretrained loaded the model in: config.json's, else the index's
    ``metadata.dtype``, else the first shard's first floating tensor (bf16 here; it was listed float16). The
    unquantized parts stay as stored."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from dtypeaudit.checks import as_policies_see_it

    _llama(256, 384).save_pretrained(tmp_path / "bf16")
    qc = BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind)
    src = tmp_path / kind
    AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=qc, device_map="cpu").save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype == "index":
        _split(src, {k for k in load_file(src / "model.safetensors") if ".mlp." in k}, "float32")
    elif dtype is not None:
        config["dtype"] = dtype
    (src / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    model.dequantize()
    reference = model.state_dict()
    listed = {t.name: t.dtype for t in as_policies_see_it(read_checkpoint(str(src)))}
    assert listed == {k: str(v.dtype).removeprefix("torch.") for k, v in reference.items()}
    assert reference[Q + ".weight"].dtype == getattr(torch, {"index": "float32", None: "bfloat16"}.get(dtype, dtype or ""))
