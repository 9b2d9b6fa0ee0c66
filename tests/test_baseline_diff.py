"""policy init writes a policy the checkpoint passes exactly, compactly; diff reports what changed."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from dtypeaudit.baseline import baseline, render_baseline
from dtypeaudit.checks import check
from dtypeaudit.diff import diff
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.policy import load_policy

from .helpers import json_report, run_cli
from .models import TinyLM


def _mixed_lm(layers: int = 24) -> dict[str, torch.Tensor]:
    model = TinyLM(layers=layers).half()
    for layer in model.layers:
        layer["norm"].float()
    return model.state_dict()


def test_baseline_passes_exactly_and_is_compact(tmp_path: Path) -> None:
    path = tmp_path / "lm.pt"
    torch.save(_mixed_lm(), path)
    inv = read_checkpoint(path)
    policy = tmp_path / "baseline.yaml"
    policy.write_text(render_baseline(inv))
    assert check(inv, load_policy(str(policy))) == []
    data = yaml.safe_load(policy.read_text())
    assert data["default"] == "float16"
    patterns = [p for r in data["rules"] if "match" in r for p in (r["match"] if isinstance(r["match"], list) else [r["match"]])]
    assert len(inv.tensors) > 100 and len(patterns) <= 2
    # Any drift from the baseline is caught.
    drifted = _mixed_lm()
    drifted["layers.3.norm.weight"] = drifted["layers.3.norm.weight"].half()
    torch.save(drifted, tmp_path / "drift.pt")
    findings = check(read_checkpoint(tmp_path / "drift.pt"), load_policy(str(policy)))
    assert {(f.rule, f.tensor) for f in findings} == {("dtype-mismatch", "layers.3.norm.weight"), ("module-dtype-mix", "layers.3.norm")}


def test_baseline_for_every_fixture(all_dtypes_pt: Path, training_pt: Path, lightning_ckpt: Path, hf_dir: Path, tmp_path: Path) -> None:
    for ckpt in (all_dtypes_pt, training_pt, lightning_ckpt, hf_dir):
        inv = read_checkpoint(ckpt)
        policy = tmp_path / f"{ckpt.name}.yaml"
        policy.write_text(render_baseline(inv))
        assert [f for f in check(inv, load_policy(str(policy))) if f.rule == "dtype-mismatch"] == [], ckpt


def test_baseline_exceptions_named_exactly_when_patterns_collide(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a.weight": torch.zeros(2), "b.weight": torch.zeros(2, dtype=torch.half), "c.weight": torch.zeros(2)}, path)
    data = baseline(read_checkpoint(path))
    assert data["rules"][1:] == [{"name": "baseline-float16", "match": "b.weight", "dtype": "float16"}]


def test_policy_init_cli_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "lm.pt"
    torch.save(_mixed_lm(4), path)
    proc = run_cli("policy", "init", str(path))
    assert proc.returncode == 0
    policy = tmp_path / "p.yaml"
    policy.write_text(proc.stdout)
    assert run_cli("policy", "validate", str(policy)).returncode == 0
    assert run_cli("scan", str(path), "--policy", str(policy), "-f", "json").returncode == 0


def test_diff(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(4, 4), "gone": torch.zeros(2), "s": torch.zeros(3)}, a)
    torch.save({"w": torch.zeros(4, 4, dtype=torch.half), "new": torch.zeros(2), "s": torch.zeros(5)}, b)
    d = diff(read_checkpoint(a), read_checkpoint(b))
    assert [t.name for t in d.added] == ["new"] and [t.name for t in d.removed] == ["gone"]
    assert [(c.name, c.dtype_changed, c.shape_changed) for c in d.changed] == [("w", True, False), ("s", False, True)]
    assert (d.bytes_before, d.bytes_after) == (64 + 8 + 12, 32 + 8 + 20)
    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 1
    assert "~ w  float32 -> float16" in proc.stdout and "- gone" in proc.stdout and "+ new" in proc.stdout
    code, doc, _ = json_report("diff", str(a), str(b))
    assert code == 1 and doc["schema"] == "dtypeaudit.diff/1" and doc["changed"][0]["dtype"] == ["float32", "float16"]
    assert run_cli("diff", str(a), str(a)).returncode == 0
