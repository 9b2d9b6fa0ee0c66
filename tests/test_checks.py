"""Checks that need no policy, and the tied-weight check that does. Module rules are checked against real forwards."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dtypeaudit.checks import check, checks_for, config_dtype, dtype_outliers, module_consistency, module_dtype_mix, tied_conflicts
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import Inventory, TensorRecord
from dtypeaudit.policy import load_policy
from dtypeaudit.rules import RULES

from .models import TinyCNN


def _forward_fails(model: TinyCNN) -> bool:
    """Run TinyCNN for real on CPU, with an input of the dtype its first layer holds."""
    try:
        with torch.no_grad():
            model.eval()(torch.ones(1, 3, 6, 6, dtype=model.conv.weight.dtype))
    except RuntimeError as exc:
        assert re.search("dtype|scalar type|should be the same", str(exc)), exc
        return True
    return False


def test_half_linear_with_fp32_bias(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.fc.bias.data = model.fc.bias.data.float()
    path = tmp_path / "mixed.pt"
    torch.save({"model": model.state_dict()}, path)
    (finding,) = module_dtype_mix(read_checkpoint(path))
    assert (finding.rule, finding.severity, finding.tensor) == ("module-dtype-mix", "error", "model.fc")
    assert "weight float16, bias float32" in finding.message and "Linear-like" in finding.message
    # The mismatch is real: the forward pass torch would run fails the way the message says.
    assert _forward_fails(model)


def test_half_batchnorm_with_fp32_statistics_is_a_mix(tmp_path: Path) -> None:
    """An fp16 BatchNorm needs fp16 statistics: 'expected scalar type Half but found Float' on CPU."""
    model = TinyCNN().half()
    model.bn.running_mean = torch.zeros(4)
    model.bn.running_var = torch.ones(4)
    path = tmp_path / "bn.pt"
    torch.save(model.state_dict(), path)
    (finding,) = module_dtype_mix(read_checkpoint(path))
    assert (finding.rule, finding.severity, finding.tensor) == ("module-dtype-mix", "error", "bn")
    assert "running_mean float32" in finding.message and "num_batches_tracked" not in finding.message
    assert _forward_fails(model)


def test_all_fp32_batchnorm_in_a_half_model_is_fine(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.bn.float()
    path = tmp_path / "bn32.pt"
    torch.save(model.state_dict(), path)
    assert module_consistency(read_checkpoint(path)) == []
    assert not _forward_fails(model)


def test_forgotten_half_is_an_outlier(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.fc.float()
    path = tmp_path / "fc32.pt"
    torch.save(model.state_dict(), path)
    inv = read_checkpoint(path)
    assert module_dtype_mix(inv) == []
    (finding,) = dtype_outliers(inv)
    assert (finding.rule, finding.severity, finding.tensor, finding.expected, finding.actual) == (
        "dtype-outlier",
        "warning",
        "fc",
        ("float16",),
        "float32",
    )
    assert "guessed" in finding.message and "--model" in finding.message
    # With module types as facts, the same finding is an error.
    typed = Inventory(inv.path, inv.format, tuple(t.with_(module=type(getattr(model, t.name.split(".")[0])).__name__) for t in inv.tensors))
    (finding,) = dtype_outliers(typed)
    assert (finding.severity, finding.tensor) == ("error", "fc") and "Linear (module type from the model)" in finding.message
    assert _forward_fails(model)


def test_checks_for_runs_the_module_rules(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.fc.float()
    model.bn.running_var = torch.ones(4)
    path = tmp_path / "both.pt"
    torch.save(model.state_dict(), path)
    rules = {(f.rule, f.tensor) for f in check(read_checkpoint(path))}
    assert rules == {("module-dtype-mix", "bn"), ("dtype-outlier", "fc")}
    assert module_consistency in checks_for(None)
    assert RULES["dtype-outlier"].severity == "warning" and "dtype-outlier" in RULES


def test_integer_buffers_are_never_mixed(tmp_path: Path) -> None:
    model = TinyCNN()
    path = tmp_path / "fp32.pt"
    torch.save(model.state_dict(), path)
    assert module_consistency(read_checkpoint(path)) == []  # num_batches_tracked is int64 beside fp32


def test_optimizer_state_is_not_a_module(training_pt: Path) -> None:
    assert module_consistency(read_checkpoint(training_pt)) == []


def test_tied_tensors_with_conflicting_rules(tied_lm_pt: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("default: fp32\nrules:\n  - match: lm_head.weight\n    dtype: fp16\n")
    (finding,) = tied_conflicts(read_checkpoint(tied_lm_pt), load_policy(str(policy)))
    assert finding.rule == "tied-dtype-conflict"
    assert "embed.weight -> float32" in finding.message and "lm_head.weight -> float16" in finding.message
    assert tied_conflicts(read_checkpoint(tied_lm_pt), load_policy("fp32")) == []


def test_views_are_not_ties(all_dtypes_pt: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("default: fp32\nrules:\n  - match: row_view\n    dtype: fp16\n")
    assert tied_conflicts(read_checkpoint(all_dtypes_pt), load_policy(str(policy))) == []


def test_config_dtype_disagrees(hf_dir: Path, tmp_path: Path) -> None:
    assert config_dtype(read_checkpoint(hf_dir)) == []
    d = tmp_path / "cfg"
    shutil.copytree(hf_dir, d)
    (d / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (finding,) = config_dtype(read_checkpoint(d))
    assert (finding.rule, finding.severity, finding.expected, finding.actual) == (
        "config-dtype-mismatch",
        "warning",
        ("bfloat16",),
        "float32",
    )


def test_unknown_modules_that_mix_are_a_warning(tmp_path: Path) -> None:
    """MultiheadAttention keeps its projection as in_proj_weight/in_proj_bias: a kind we do not model, so a warning."""
    mha = torch.nn.MultiheadAttention(8, 2).half()
    mha.in_proj_bias.data = mha.in_proj_bias.data.float()  # type: ignore[union-attr]
    path = tmp_path / "mha.pt"
    torch.save({"attn": mha.state_dict()}, path)
    (finding,) = module_dtype_mix(read_checkpoint(path))
    assert (finding.severity, finding.tensor) == ("warning", "attn") and "unknown kind" in finding.message
    x = torch.ones(3, 1, 8, dtype=torch.half)
    with pytest.raises(RuntimeError, match="dtype|scalar type"):  # torch agrees that it fails
        mha(x, x, x)
    # Loose tensors at the root of a dict are not a module.
    torch.save({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.half)}, tmp_path / "loose.pt")
    assert module_consistency(read_checkpoint(tmp_path / "loose.pt")) == []


def test_fp8_scales_are_not_held_to_the_kernel_rule() -> None:
    """fp8 checkpoints keep fp32 scales beside fp8 weights and bf16 norms; no torch forward of these was measured."""
    records = (
        TensorRecord("q_proj.weight", "float8_e4m3fn", (8, 8), 64),
        TensorRecord("q_proj.weight_scale", "float32", (), 4),
        TensorRecord("k_proj.weight", "float8_e4m3fn", (8, 8), 64),
        TensorRecord("norm.weight", "bfloat16", (8,), 16),
    )
    assert module_consistency(Inventory("fp8", "test", records)) == []
