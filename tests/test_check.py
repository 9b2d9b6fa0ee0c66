"""Checks that need no policy, and the tied-weight check that does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dtypeaudit.check import config_dtype, module_dtype_mix, tied_conflicts
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.policy import load_policy

from .conftest import TinyCNN


def test_half_linear_with_fp32_bias(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.fc.bias.data = model.fc.bias.data.float()
    path = tmp_path / "mixed.pt"
    torch.save({"model": model.state_dict()}, path)
    (finding,) = module_dtype_mix(read_checkpoint(path))
    assert (finding.rule, finding.severity, finding.tensor) == ("module-dtype-mix", "error", "model.fc")
    assert "weight float16, bias float32" in finding.message
    # The mismatch is real: the forward pass torch would run fails the way the message says.
    import pytest

    with pytest.raises(RuntimeError, match="dtype|scalar type"):
        torch.nn.functional.linear(torch.ones(1, 8, dtype=torch.half), model.fc.weight, model.fc.bias)


def test_batchnorm_stats_in_fp32_are_not_a_mix(tmp_path: Path) -> None:
    model = TinyCNN().half()
    model.bn.running_mean = model.bn.running_mean.float()
    model.bn.running_var = model.bn.running_var.float()
    path = tmp_path / "bn.pt"
    torch.save(model.state_dict(), path)
    assert module_dtype_mix(read_checkpoint(path)) == []


def test_optimizer_state_is_not_a_module(training_pt: Path) -> None:
    assert module_dtype_mix(read_checkpoint(training_pt)) == []


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
