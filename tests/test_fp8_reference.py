"""``convert --fp8-reference``: where transformers' and DeepSeek's FP8 references read one file differently (issue
31), convert refuses until told which to follow, then writes that reference's weights bit for bit.

The references: transformers 5.24 ``from_pretrained`` with ``FineGrainedFP8Config(dequantize=True)`` (the block is
the weight's size over the scale grid's, which must divide it), and DeepSeek-V3's ``weight_dequant``
(``inference/kernel.py``), written below in torch as its Triton kernel computes: program (i, j) loads block (i, j)
of the weight (the config's ``weight_block_size``, the grid ceil-divided, masked at the bottom and right edges) as
float32, multiplies it by ``s[i * cdiv(N, bs) + j]`` (the scales read flat) and stores it in the output dtype.
The folders are tiny Llamas whose Linears transformers' ``replace_with_fp8_linear`` made ``FP8Linear`` (the
DeepSeek-V3 layout: a ceil-divided grid), values filled in, and written by safetensors' ``save_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dtypeaudit.checks import check
from dtypeaudit.formats import read_checkpoint

from .helpers import run_cli
from .test_quant_edges import FP8_CONFIG, Q, _allocated, _bit_equal, _config, _quantized, _write

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SCALE = "_scale_inv"


def _deepseek_dequant(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant`` (``weight_dequant_kernel`` over a ``(cdiv(M, bs), cdiv(N, bs))`` grid), one
    program at a time; ``block`` (rows, cols) generalises its square ``BLOCK_SIZE`` to the config's two sizes."""
    assert x.dim() == 2 and s.dim() == 2
    m, n = x.shape
    bm, bn = block
    per_row = -(-n // bn)
    flat = s.contiguous().reshape(-1)
    y = torch.empty(m, n, dtype=dtype)
    for pid_m in range(-(-m // bm)):
        for pid_n in range(per_row):
            rows, cols = slice(pid_m * bm, (pid_m + 1) * bm), slice(pid_n * bn, (pid_n + 1) * bn)
            y[rows, cols] = (x[rows, cols].to(torch.float32) * flat[pid_m * per_row + pid_n].to(torch.float32)).to(dtype)
    return y


def _deepseek_state(state: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The whole state as DeepSeek's code gives it: each FP8 weight by ``weight_dequant``, the rest cast."""
    out = {}
    for k, v in state.items():
        if k.endswith(SCALE):
            continue
        out[k] = _deepseek_dequant(v, state[k + SCALE], block, dtype) if k + SCALE in state else v.to(dtype)
    return out


def _from_pretrained(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.state_dict()


def _convert(src: Path, out: Path, *options: str) -> Any:
    return run_cli("convert", str(src), "--to", "bf16", "-o", str(out), *options)


def _converted(src: Path, out: Path, *options: str) -> dict[str, torch.Tensor]:
    proc = _convert(src, out, *options)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return load_file(out / "model.safetensors")


def _refused(src: Path, out: Path, *options: str) -> str:
    """Exit 2, one line, nothing written (no output, no temporary)."""
    proc = _convert(src, out, *options)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]
    return lines[0]


def _findings(path: Path) -> list[Any]:
    return [f for f in check(read_checkpoint(str(path))) if f.rule == "quant-scale-shape"]


def test_partial_edges_both_load_each_reference_bit_for_bit(tmp_path: Path) -> None:
    """200x300 with FP8Linear's ceil grids ([2, 2], [3, 2], [2, 3]): from_pretrained reads 100-row blocks,
    DeepSeek's code 128-row blocks with a 72-row edge. The scan names both (warnings: both load); convert refuses
    without the option, naming it; with it, each choice is that reference's weights bit for bit."""
    model, state = _allocated(200, 300)
    assert tuple(state[Q + ".weight" + SCALE].shape) == (2, 2)
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    found = _findings(src)
    assert found and {f.severity for f in found} == {"warning"}
    assert all("DeepSeek" in f.message and "from_pretrained" in f.message and "--fp8-reference" in f.message for f in found)

    line = _refused(src, tmp_path / "out")
    assert "--fp8-reference transformers" in line and "--fp8-reference deepseek" in line and "DeepSeek" in line

    transformers = _from_pretrained(src)
    deepseek = _deepseek_state(state, (128, 128))
    _bit_equal(_converted(src, tmp_path / "tf", "--fp8-reference", "transformers"), transformers)
    _bit_equal(_converted(src, tmp_path / "ds", "--fp8-reference", "deepseek"), deepseek)
    planned = run_cli("convert", str(src), "--to", "bf16", "--fp8-reference", "deepseek", "--dry-run")
    assert planned.returncode == 0 and "7 FP8 weights that the two references read differently follow DeepSeek's" in planned.stdout
    # the two references do give different weights here: each comparison above could fail
    assert not torch.equal(transformers[Q + ".weight"].view(torch.uint8), deepseek[Q + ".weight"].view(torch.uint8))


def test_576_rows_over_a_grid_of_5_only_deepseek_reads(tmp_path: Path) -> None:
    """DeepSeek-V3's kv_a_proj_with_mqa shape: 576 rows over a grid of 5 (128-row blocks, the last 64 rows), here as
    gate/up [576, 256] and down [256, 576]. from_pretrained refuses to load it; so does convert without the option
    and with ``transformers``; ``deepseek`` converts it, bit-equal to weight_dequant."""
    from transformers import AutoModelForCausalLM

    model, state = _allocated(256, 576)
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert tuple(state[gate].shape) == (576, 256) and tuple(state[gate + SCALE].shape) == (5, 2)
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    with pytest.raises(RuntimeError):
        AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    errors = [f for f in _findings(src) if f.tensor == gate + SCALE]
    assert [f.severity for f in errors] == ["error"]
    assert "DeepSeek" in errors[0].message and "from_pretrained" in errors[0].message and "--fp8-reference deepseek" in errors[0].message

    assert "--fp8-reference deepseek" in _refused(src, tmp_path / "out")
    line = _refused(src, tmp_path / "out", "--fp8-reference", "transformers")
    assert "from_pretrained cannot load" in line and "does not divide" in line

    mine = _converted(src, tmp_path / "ds", "--fp8-reference", "deepseek")
    _bit_equal(mine, _deepseek_state(state, (128, 128)))
    # the partial last block holds its own scale: rows 512..575 are block 4's
    last = state[gate + SCALE][4, 0].to(torch.float32)
    assert torch.equal(mine[gate][512:, :128], (state[gate][512:, :128].to(torch.float32) * last).to(torch.bfloat16))


def test_where_the_references_agree_every_choice_writes_the_same_bytes(tmp_path: Path) -> None:
    """128x128 blocks that divide every weight (transformers' own writer, Fp8Quantize): no finding, and the default,
    ``transformers`` and ``deepseek`` each write what from_pretrained loads and weight_dequant computes."""
    model, state = _quantized()
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    assert _findings(src) == []
    reference = _from_pretrained(src)
    _bit_equal(_deepseek_state(state, (128, 128)), reference)
    for choice in ((), ("--fp8-reference", "transformers"), ("--fp8-reference", "deepseek")):
        _bit_equal(_converted(src, tmp_path / ("out" + "-".join(choice)), *choice), reference)


def test_a_grid_deepseek_cannot_read_is_refused_when_told_to_follow_it(tmp_path: Path) -> None:
    """weight_block_size 128x128 but a [4, 4] grid over 256x256: from_pretrained reads 64x64 blocks (convert follows
    it by default and with ``transformers``); DeepSeek's kernel would index past its scales, so ``deepseek`` refuses."""
    model, state = _quantized()
    state[Q + ".weight" + SCALE] = torch.rand((4, 4), generator=torch.Generator().manual_seed(2)) + 0.5
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    reference = _from_pretrained(src)
    _bit_equal(_converted(src, tmp_path / "default"), reference)
    _bit_equal(_converted(src, tmp_path / "tf", "--fp8-reference", "transformers"), reference)
    line = _refused(src, tmp_path / "ds", "--fp8-reference", "deepseek")
    assert Q in line and "DeepSeek" in line


def test_an_unknown_reference_is_refused_before_any_read(tmp_path: Path) -> None:
    proc = _convert(tmp_path / "missing", tmp_path / "out", "--fp8-reference", "vllm")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dtypeaudit: error: --fp8-reference must be transformers or deepseek, not 'vllm'"]


@pytest.mark.parametrize("hidden, inter", [(200, 300), (256, 576)], ids=["both-load", "576-over-5"])
def test_torch_dequantizer_follows_the_chosen_reference(tmp_path: Path, hidden: int, inter: int) -> None:
    """The torch path (``dequant.dequantize``: a weight the numpy path does not take) reads the same blocks as the
    numpy one: DeepSeek's where told, from_pretrained's where told and it loads, refused where not told."""
    from dtypeaudit.errors import ConversionError
    from dtypeaudit.quant import dequant as dq
    from dtypeaudit.quant.group import view

    model, state = _allocated(hidden, inter)
    src = _write(tmp_path / "fp8", state, _config(model, FP8_CONFIG))
    name = "model.layers.0.mlp.gate_proj.weight"
    (w,) = [w for w in view(read_checkpoint(str(src))).weights if w.name == name]
    tensors = {"weight": state[name], "scale": state[name + SCALE]}
    deepseek = dq.dequantize(w, tensors, "deepseek")
    want = _deepseek_dequant(state[name], state[name + SCALE], (128, 128), torch.float32)
    assert torch.equal(deepseek.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ConversionError, match="--fp8-reference"):
        dq.dequantize(w, tensors)
    if inter == 576:
        with pytest.raises(ConversionError, match="from_pretrained cannot load"):
            dq.dequantize(w, tensors, "transformers")
    else:
        transformers = dq.dequantize(w, tensors, "transformers").to(torch.bfloat16)
        assert torch.equal(transformers.view(torch.uint8), _from_pretrained(src)[name].view(torch.uint8))
