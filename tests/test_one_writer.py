"""A dequantizing conversion writes through the cast's own writer (conversion/write.py): its tensors that are not
quantized are cast and checked as a plain cast's records are, in the same file as the dequantized weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from .helpers import run_cli
from .test_quant_convert import make_fp8_dir


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_dir(tmp_path_factory.mktemp("fp8-writer"))


def _with_float32_norm(fp8_dir: Path, tmp_path: Path, value: float) -> tuple[Path, str, torch.Tensor]:
    """A copy of ``fp8_dir`` whose final norm is float32 holding ``value``: a tensor the dequantizer casts."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fp8_dir, src)
    name = "model.norm.weight"
    for f in src.glob("*.safetensors"):
        state = load_file(f)
        if name in state:
            norm = state[name].to(torch.float32)
            norm[0] = value
            state[name] = norm
            save_file(state, f, metadata={"format": "pt"})
            return src, name, norm
    raise AssertionError("no final norm")


def test_a_cast_tensor_of_a_quantized_folder_gets_the_casts_verdict(fp8_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, name, norm = _with_float32_norm(fp8_dir, tmp_path, 1e6)
    proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(tmp_path / "refused"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{name}: 1 values beyond ±65504 would become inf" in proc.stdout and "--clamp" in proc.stdout
    assert not (tmp_path / "refused").exists()

    proc = run_cli("convert", str(src), "--to", "fp16", "--dry-run", "--check-values")
    assert proc.returncode == 1 and f"{name}: 1 values beyond" in proc.stdout, proc.stdout + proc.stderr

    out = tmp_path / "clamped"
    proc = run_cli("convert", str(src), "--to", "fp16", "--clamp", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    want = norm.clamp(-65504, 65504).to(torch.float16)
    assert torch.equal(got[name].view(torch.int16), want.view(torch.int16))
    # every other tensor the dequantizer did not dequantize: torch's own cast of the source's values
    source = {k: v for f in fp8_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    plain = [k for k, v in source.items() if v.dtype == torch.bfloat16 and k != name]
    assert plain
    for k in plain:
        assert torch.equal(got[k].view(torch.int16), source[k].to(torch.float16).view(torch.int16)), k


def test_the_progress_of_a_dequantizing_write_adds_up_to_its_total(fp8_dir: Path, tmp_path: Path) -> None:
    """The bar is told the bytes the writer will count (a dequantized weight's made, every other record's read),
    so it ends at its total (a bar advanced past it had lost its task)."""
    from dtypeaudit import convert

    src, _, _ = _with_float32_norm(fp8_dir, tmp_path, 1.0)
    bars: list[list[int]] = []

    def bar(label: str, total: int):  # type: ignore[no-untyped-def]
        bars.append([total, 0])
        return lambda n: bars[-1].__setitem__(1, bars[-1][1] + n)

    result = convert(src, "bf16", output=tmp_path / "out", progress_factory=bar)
    assert result.output is not None
    assert [total for total, _ in bars] == [done for _, done in bars] and bars[0][0] > 0
