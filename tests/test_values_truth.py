"""Value verdicts that mean what users need, on checkpoints made the way users make them: a training
checkpoint after real Adam steps passes ``scan --values`` (its moments are optimizer state, which
convert leaves alone), NaN is refused for every target, and bf16 models get no fp16 notes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from .helpers import json_report, run_cli


def _findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["checkpoints"][0]["findings"])


def _tutorial_checkpoint(path: Path) -> Path:
    """The PyTorch tutorial's checkpoint after three real Adam steps on a classifier."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    torch.save({"epoch": 3, "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "loss": loss.item()}, path)
    return path


def test_training_checkpoint_passes_with_adam_moments_as_info(tmp_path: Path) -> None:
    path = _tutorial_checkpoint(tmp_path / "train.pt")
    code, doc, _ = json_report("scan", str(path), "--values")
    assert code == 0
    optimizer = [f for f in _findings(doc) if f["tensor"].startswith("optimizer_state_dict.")]
    # exp_avg_sq of real gradients sits far below fp16's range: these would be errors as weights.
    assert any(f["rule"] == "fp16-underflow" and f["tensor"].endswith("exp_avg_sq") for f in optimizer)
    assert optimizer and all(f["severity"] == "info" and "optimizer state" in f["message"] for f in optimizer)
    # ... and convert leaves that state alone, so the verdicts agree.
    assert run_cli("convert", str(path), "--to", "fp16", "--dry-run").returncode == 0

    code, full, _ = json_report("scan", str(path), "--values", "--include-optimizer")
    assert code == 1
    held = [f for f in _findings(full) if f["tensor"].startswith("optimizer_state_dict.")]
    assert [(f["rule"], f["tensor"]) for f in held] == [(f["rule"], f["tensor"]) for f in optimizer]
    underflow = [f for f in held if f["rule"] == "fp16-underflow"]
    assert underflow and all(f["severity"] == "error" for f in underflow)  # more than 1% of each flushes to zero
    assert all(f["severity"] == "info" for f in held if f["rule"] == "fp16-subnormal")
    assert all("optimizer state" not in f["message"] for f in held)
    model = [f for f in _findings(doc) if f["tensor"].startswith("model_state_dict.")]
    assert model == [f for f in _findings(full) if f["tensor"].startswith("model_state_dict.")]


def test_include_optimizer_without_values_is_misuse(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, path)
    proc = run_cli("scan", str(path), "--include-optimizer")
    assert proc.returncode == 2 and "--include-optimizer applies to --values" in proc.stderr


def _with_nan(dtype: torch.dtype, path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)
    with torch.no_grad():
        model[0].weight[2, 3] = float("nan")
    torch.save(model.state_dict(), path)
    return path


def test_bf16_model_with_nan_is_an_error_and_convert_refuses_it(tmp_path: Path) -> None:
    src = _with_nan(torch.bfloat16, tmp_path / "bf16.pt")
    code, doc, _ = json_report("scan", str(src), "--values")
    assert code == 1
    assert [(f["rule"], f["severity"], f["tensor"]) for f in _findings(doc)] == [("non-finite", "error", "0.weight")]
    before = sorted(p.name for p in tmp_path.iterdir())
    for target in ("bf16", "fp16", "fp32"):
        for extra in ((), ("--clamp",)):  # NaN cannot be saturated
            proc = run_cli("convert", str(src), "--to", target, *extra)
            assert proc.returncode == 1, (target, extra)
            assert "0.weight: 1 NaN/Inf already present" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_keep_unsafe_writes_the_nan_as_it_is_and_says_so(tmp_path: Path) -> None:
    src = _with_nan(torch.bfloat16, tmp_path / "bf16.pt")
    out = tmp_path / "out.pt"
    proc = run_cli("convert", str(src), "--to", "bf16", "--keep-unsafe", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "0.weight: 1 NaN/Inf already present; kept as it is (--keep-unsafe)" in proc.stdout
    got = torch.load(out, weights_only=True)
    assert math.isnan(float(got["0.weight"][2, 3])) and got["0.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_nan_refused_on_the_way_to_bf16_from_any_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    src = _with_nan(dtype, tmp_path / "m.pt")
    proc = run_cli("convert", str(src), "--to", "bf16", "-f", "json")
    assert proc.returncode == 1
    assert not (tmp_path / "m.bfloat16.pt").exists() and len(list(tmp_path.iterdir())) == 1


def _tiny_weights(dtype: torch.dtype, path: Path, *, norm_dtype: torch.dtype | None = None) -> Path:
    """A model whose weights hold values in fp16's subnormal range and below it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
    with torch.no_grad():
        model[0].weight[0] = 1e-6  # fp16 subnormal
        model[0].weight[1, :2] = 1e-9  # zero in fp16: 2 of 256 values (under 1%), a warning
        model[1].bias.fill_(1e-6)
    if norm_dtype is not None:
        model[1].to(norm_dtype)
    torch.save(model.state_dict(), path)
    return path


@pytest.mark.parametrize(("dtype", "norm"), [(torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float16, None)])
def test_half_models_get_no_fp16_notes(tmp_path: Path, dtype: torch.dtype, norm: torch.dtype | None) -> None:
    """bf16 keeps fp32's exponent, and an fp16 tensor is already what it is: neither is held to fp16's range,
    nor are the fp32 norms beside bf16 weights (that checkpoint is bound for bf16)."""
    path = _tiny_weights(dtype, tmp_path / "half.pt", norm_dtype=norm)
    proc = run_cli("scan", str(path), "--values")
    assert proc.returncode == 0 and "fp16-" not in proc.stdout, proc.stdout
    code, doc, _ = json_report("scan", str(path), "--values")
    assert code == 0 and _findings(doc) == []


def test_fp32_model_is_held_to_fp16s_range(tmp_path: Path) -> None:
    path = _tiny_weights(torch.float32, tmp_path / "fp32.pt")
    code, doc, _ = json_report("scan", str(path), "--values")
    assert code == 0
    got = {(f["rule"], f["severity"], f["tensor"]) for f in _findings(doc)}
    assert got == {("fp16-underflow", "warning", "0.weight"), ("fp16-subnormal", "info", "1.bias")}


def test_fp32_norms_beside_fp16_weights_are_held_to_fp16s_range(tmp_path: Path) -> None:
    path = _tiny_weights(torch.float16, tmp_path / "mixed.pt", norm_dtype=torch.float32)
    code, doc, _ = json_report("scan", str(path), "--values")
    assert code == 0 and [(f["rule"], f["tensor"]) for f in _findings(doc)] == [("fp16-subnormal", "1.bias")]
