"""The library API a script uses, and what importing it costs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dtypeaudit

from .helpers import ROOT


def test_library_round_trip(tmp_path: Path) -> None:
    inv = dtypeaudit.read(ROOT / "sample_models" / "cnn_half_converted.pt")
    policy = dtypeaudit.load_policy("fp16-mixed")
    rules = {f.rule for f in dtypeaudit.check(inv, policy)}
    assert rules == {"module-dtype-mix", "dtype-mismatch"}
    report = dtypeaudit.scan([str(ROOT / "sample_models" / "cnn_fp32.pt")], checks=dtypeaudit.checks_for(policy))
    assert {f.actual for f in report.findings} == {"float32"}
    result = dtypeaudit.convert(ROOT / "sample_models" / "cnn_fp32.pt", "fp16", policy=policy, output=tmp_path / "out.pt")
    assert result.output == tmp_path / "out.pt"
    assert dtypeaudit.check(dtypeaudit.read(tmp_path / "out.pt"), policy) == []


def test_importing_the_package_loads_neither_torch_nor_yaml() -> None:
    code = "import sys, dtypeaudit; print(sorted(m for m in ('torch', 'yaml', 'rich', 'dtypeaudit.conversion') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_the_library_scan_fails_at_the_policys_own_fail_on(tmp_path: Path) -> None:
    """dtypeaudit.scan without fail_on takes the policy's fail_on, as `dtypeaudit scan --policy` does; a fail_on given
    wins; no policy: error."""
    from tests.helpers import ROOT

    sample = str(ROOT / "sample_models" / "cnn_fp32.pt")
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text("version: 1\nfail_on: warning\ndefault: float32\n")
    policy = dtypeaudit.load_policy(str(policy_file))
    assert dtypeaudit.scan([sample], policy=policy).fail_on == "warning"
    assert dtypeaudit.scan([sample], policy=policy, fail_on="error").fail_on == "error"
    assert dtypeaudit.scan([sample]).fail_on == "error"
