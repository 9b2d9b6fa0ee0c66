"""The pre-commit hook, the GitHub Action definition, the policy subcommands and --explain, as users run them."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import yaml

from .helpers import ROOT, run_cli


def test_precommit_hook_command_line(tmp_path: Path) -> None:
    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "dtypeaudit" and hook["language"] == "python"
    import re

    files = re.compile(hook["files"])
    staged = ["sample_models/cnn_fp32.pt", "sample_models/block_bf16.safetensors", "scripts/make_samples.py", "README.md"]
    matched = [f for f in staged if files.search(f)]
    assert matched == ["sample_models/cnn_fp32.pt", "sample_models/block_bf16.safetensors"]
    entry = shlex.split(hook["entry"])
    assert entry[0] == "dtypeaudit"
    # pre-commit runs: entry + args + the matched files.
    ok = run_cli(*entry[1:], *matched, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    failing = run_cli(*entry[1:], "--preset", "fp16", *matched, cwd=ROOT)
    assert failing.returncode == 1 and "dtype-mismatch" in failing.stdout


def test_action_definition_runs_the_cli() -> None:
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    assert action["runs"]["using"] == "composite"
    assert set(action["inputs"]) >= {"paths", "policy", "preset", "fail-on", "sarif"}
    script = "\n".join(step["run"] for step in action["runs"]["steps"])
    assert "--format sarif" in script and "--format github" in script


def test_explain(tmp_path: Path) -> None:
    out = run_cli("scan", "sample_models/cnn_half_converted.pt", "--preset", "fp16-mixed", "--explain", "model.bn.running_var", cwd=ROOT)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert "model.bn.running_var: float16 [8]" in lines[1]
    assert any("· optimizer-state-fp32: skipped, region model is not optimizer" in line for line in lines)
    assert any("✓ batchnorm-statistics-fp32: matches, expects float32" in line for line in lines)
    assert lines[-1] == "verdict: float16 fails (error)"
    passing = run_cli("scan", "sample_models/cnn_half_converted.pt", "--preset", "fp16-mixed", "--explain", "model.conv.weight", cwd=ROOT)
    assert passing.returncode == 0 and "✓ weights-fp16: matches, expects float16" in passing.stdout
    missing = run_cli("scan", "sample_models/cnn_fp32.pt", "--preset", "fp16", "--explain", "nope", cwd=ROOT)
    assert missing.returncode == 2 and "no tensor named 'nope'" in missing.stderr


def test_policy_validate_and_presets(tmp_path: Path) -> None:
    good = run_cli("policy", "validate", "fp16-mixed", str(ROOT / "configs" / "bf16.yaml"))
    assert good.returncode == 0 and "fp16-mixed: valid (8 rules, extends" in good.stdout  # an alias of fp16-weights-fp32-norms
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - match: x\n    dtype: fp17\n")
    proc = run_cli("policy", "validate", str(bad))
    assert proc.returncode == 2 and f"{bad}:4: unknown dtype 'fp17'" in proc.stderr and "Traceback" not in proc.stderr
    listing = run_cli("policy", "presets")
    assert listing.returncode == 0 and "fp16-mixed" in listing.stdout


def test_bad_policy_on_scan_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("defualt: fp16\n")
    proc = run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(bad), cwd=ROOT)
    assert proc.returncode == 2 and "unknown key 'defualt'" in proc.stderr and proc.stdout == ""
    both = run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(bad), "--preset", "fp16", cwd=ROOT)
    assert both.returncode == 2 and "not both" in both.stderr


def test_policy_fail_on_and_cli_override(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("fail_on: warning\ndefault: {dtype: fp16, severity: warning}\n")
    assert run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(policy), cwd=ROOT).returncode == 1
    assert run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(policy), "--fail-on", "error", cwd=ROOT).returncode == 0


def test_many_checkpoints_in_parallel(tmp_path: Path) -> None:
    for i in range(6):
        shutil.copy(ROOT / "sample_models" / "cnn_fp32.pt", tmp_path / f"m{i}.pt")
    proc = run_cli("scan", str(tmp_path / "*.pt"), "--preset", "fp32", "-f", "json", "-j", "2")
    assert proc.returncode == 0
    import json

    assert [Path(c["path"]).name for c in json.loads(proc.stdout)["checkpoints"]] == [f"m{i}.pt" for i in range(6)]


def test_python_dash_m_and_completion() -> None:
    assert run_cli("--help").returncode == 0
    assert "--install-completion" in run_cli("--help").stdout
