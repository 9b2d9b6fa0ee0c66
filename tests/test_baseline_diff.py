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


class _Calls:
    """Unpickles as a call of posix.system: torch.save writes it as any other object (nothing here runs it)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo never-run",))


def test_policy_init_and_diff_refuse_what_scan_fails_for_its_safety(tmp_path: Path) -> None:
    import pickle

    evil_pt, evil_pkl, clean = tmp_path / "evil.pt", tmp_path / "evil.pkl", tmp_path / "clean.pt"
    torch.save({"w": torch.ones(2), "x": _Calls()}, evil_pt)
    evil_pkl.write_bytes(pickle.dumps({"x": _Calls()}, protocol=2))
    torch.save({"w": torch.ones(2)}, clean)
    assert run_cli("scan", str(evil_pt), "-q").returncode == 1  # the verdict the others must not contradict

    out = tmp_path / "baseline.yaml"
    r = run_cli("policy", "init", str(evil_pt), "-o", str(out))
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.strip().splitlines() == [
        f"dtypeaudit: error: {evil_pt}: policy init refuses it: unsafe-global: calls posix.system, which can execute code "
        f"when loaded; it was not executed; `dtypeaudit scan {evil_pt}` lists each"
    ]
    for a, b in ((evil_pkl, evil_pkl), (evil_pt, clean), (clean, evil_pt)):
        r = run_cli("diff", str(a), str(b))
        bad = a if a != clean else b
        assert r.returncode == 1, (a, b)
        assert "identical" not in r.stdout
        assert r.stderr.strip().splitlines() == [line for line in r.stderr.strip().splitlines() if str(bad) in line]
        assert len(r.stderr.strip().splitlines()) == 1 and "diff refuses it: unsafe-global: calls posix.system" in r.stderr
    assert run_cli("diff", str(clean), str(clean)).returncode == 0


def test_policy_init_says_it_wrote_a_policy(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    r = run_cli("policy", "init", "sample_models/cnn_fp32.pt", "-o", str(out))
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.strip() == f"dtypeaudit: policy written to {out}"
    assert run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(out), "-q").returncode == 0


def test_diff_takes_scans_format_names(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.ones(2)}, a)
    torch.save({"w": torch.ones(2).half()}, b)
    texts = {fmt: run_cli("diff", str(a), str(b), "-f", fmt) for fmt in ("table", "plain", "text")}
    assert {r.returncode for r in texts.values()} == {1}
    assert texts["table"].stdout == texts["plain"].stdout == texts["text"].stdout and "float32 -> float16" in texts["plain"].stdout
    bad = run_cli("diff", str(a), str(b), "-f", "sarif")
    assert bad.returncode == 2 and "diff writes table, plain, json or html, not 'sarif'" in bad.stderr
