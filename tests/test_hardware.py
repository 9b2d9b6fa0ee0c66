"""Hardware targets: the table's facts, each finding on each target class, --target on scan and convert, `targets`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dtypeaudit import dtypes, hardware
from dtypeaudit.errors import UsageError
from dtypeaudit.inventory import Inventory, TensorRecord

from .helpers import ROOT, run_cli

FLOATING = [name for name, d in dtypes.DTYPES.items() if d.is_floating]


def _inv(*pairs: tuple[str, str]) -> Inventory:
    return Inventory("t.pt", "torch-zip", tuple(TensorRecord(n, d, (4, 4), 16 * dtypes.get(d).itemsize) for n, d in pairs))


def _rules(target: str, dtype: str) -> list[str]:
    return [f.rule for f in hardware.target_findings(_inv(("w", dtype)), target)]


# Each finding on each target class. AMD's and Apple's rows emulate nothing: each floating type is computed
# natively or refused, so for them the test is that no dtype is emulated.
@pytest.mark.parametrize(
    "target, dtype, rule",
    [
        # CPUs
        ("cpu", "float16", "emulated-dtype"),
        ("cpu", "bfloat16", "emulated-dtype"),
        ("cpu", "float8_e4m3fn", "emulated-dtype"),
        ("cpu-avx512bf16", "float16", "emulated-dtype"),
        ("cpu-amx", "float4_e2m1fn_x2", "unsupported-dtype"),
        ("cpu", "float8_e8m0fnu", "unsupported-dtype"),
        # NVIDIA by compute capability
        ("v100", "bfloat16", "emulated-dtype"),
        ("t4", "bfloat16", "emulated-dtype"),
        ("t4", "float8_e4m3fn", "unsupported-dtype"),
        ("a100", "float8_e5m2", "unsupported-dtype"),
        ("a10", "float8_e4m3fn", "unsupported-dtype"),
        ("h100", "float4_e2m1fn_x2", "unsupported-dtype"),
        ("h100", "float8_e4m3fnuz", "unsupported-dtype"),
        # AMD
        ("mi200", "float8_e4m3fnuz", "unsupported-dtype"),
        ("mi300", "float8_e4m3fn", "unsupported-dtype"),
        ("mi300", "float4_e2m1fn_x2", "unsupported-dtype"),
        # Apple
        ("mps", "float64", "unsupported-dtype"),
        ("mps", "float8_e5m2", "unsupported-dtype"),
    ],
)
def test_finding_on_each_target_class(target: str, dtype: str, rule: str) -> None:
    assert _rules(target, dtype) == [rule]
    f = hardware.target_findings(_inv(("w", dtype)), target)[0]
    assert f.severity == ("error" if rule == "unsupported-dtype" else "warning")
    assert f.tensor == "w" and f.actual == dtype and dtype not in (f.expected or ())
    assert f.message.startswith(f"{dtype} ") and hardware.resolve(target).name in f.message


@pytest.mark.parametrize(
    "target, dtype",
    [
        ("cpu", "float32"),
        ("cpu-avx512bf16", "bfloat16"),
        ("cpu-amx", "float16"),
        ("v100", "float16"),
        ("t4", "float16"),
        ("a100", "bfloat16"),
        ("l4", "float8_e4m3fn"),
        ("h100", "float8_e5m2"),
        ("b200", "float4_e2m1fn_x2"),
        ("mi200", "bfloat16"),
        ("mi300", "float8_e4m3fnuz"),
        ("mps", "float16"),
        ("mps", "bfloat16"),
    ],
)
def test_native_dtypes_raise_nothing(target: str, dtype: str) -> None:
    assert _rules(target, dtype) == []


@pytest.mark.parametrize("vendor", ["amd", "apple"])
def test_amd_and_apple_rows_emulate_nothing(vendor: str) -> None:
    rows = [t for t in hardware.TARGETS if t.vendor == vendor]
    assert rows
    for t in rows:
        assert all(_rules(t.name, d) != ["emulated-dtype"] for d in FLOATING), t.name


def test_every_vendor_class_has_rows() -> None:
    assert {t.vendor for t in hardware.TARGETS} == set(hardware.VENDORS)


def test_fp8_follows_compute_capability() -> None:
    """fp8 before compute capability 8.9 is an error, from 8.9 native; bf16 before 8.0 is emulated."""
    for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        t = hardware.resolve(f"sm_{cc[0]}{cc[1]}")
        assert t.compute_capability == cc
        assert t.supports("float8_e4m3fn") == ("native" if cc >= (8, 9) else "unsupported")
        assert t.supports("bfloat16") == ("native" if cc >= (8, 0) else "emulated")
        assert t.support["tf32"] == ("native" if cc >= (8, 0) else "unsupported")


def test_integers_and_integral_types_are_not_judged() -> None:
    assert hardware.target_findings(_inv(("ids", "int64"), ("mask", "bool"), ("c", "complex64")), "mps") == []


def test_every_floating_dtype_has_a_column_and_every_refusal_a_reason() -> None:
    assert set(hardware.COLUMN_OF) == set(FLOATING)
    for t in hardware.TARGETS:
        assert set(t.support) == {label for label, _ in hardware.COLUMNS}
        for label, support in t.support.items():
            if support != "native":
                assert t.notes.get(label), (t.name, label)
        assert t.source, t.name


def test_every_row_cites_vendor_documentation_in_a_comment() -> None:
    """Each row (a Target or _nvidia call) has a comment above it naming the vendor documentation."""
    source = (ROOT / "dtypeaudit" / "hardware.py").read_text(encoding="utf-8").splitlines()
    calls = [i for i, line in enumerate(source) if re.match(r"\s+(Target\(|_nvidia\(\")", line)]
    assert len(calls) == len(hardware.TARGETS)
    for i in calls:
        above = source[i - 1].strip()
        assert above.startswith("#"), source[i]
        block = []
        j = i - 1
        while source[j].strip().startswith("#"):
            block.append(source[j])
            j -= 1
        text = " ".join(block)
        assert re.search(r"(nvidia|intel|amd|apple|rocm)", text, re.I), source[i]


@pytest.mark.parametrize(
    "spelling, name",
    [("V100", "v100"), ("sm_86", "a10"), ("cc8.9", "l4"), ("9.0", "h100"), ("MI300X", "mi300"), ("avx512_bf16", "cpu-avx512bf16")],
)
def test_names_aliases_and_compute_capabilities(spelling: str, name: str) -> None:
    assert hardware.resolve(spelling).name == name


def test_unknown_targets_say_what_exists() -> None:
    with pytest.raises(UsageError, match="v100, t4, a100"):
        hardware.resolve("k80")
    with pytest.raises(UsageError, match="below 7.0"):
        hardware.resolve("sm_61")


def test_suggestions_point_to_a_native_dtype() -> None:
    assert hardware.suggestion(hardware.resolve("t4"), "bfloat16") == "float16"
    assert hardware.suggestion(hardware.resolve("mi300"), "float8_e4m3fn") == "float8_e4m3fnuz"
    assert hardware.suggestion(hardware.resolve("mps"), "float64") == "float32"
    assert hardware.suggestion(hardware.resolve("a100"), "float8_e5m2") == "float16"
    for t in hardware.TARGETS:
        for d in FLOATING:
            s = hardware.suggestion(t, d)
            assert s is None or t.supports(s) == "native"


def test_readme_shows_the_table() -> None:
    page = (ROOT / "docs" / "targets.md").read_text(encoding="utf-8")
    assert hardware.render_markdown() in page


# -- the command line -----------------------------------------------------------------------------------------------


def test_targets_command_lists_the_table() -> None:
    r = run_cli("targets")
    assert r.returncode == 0, r.stderr
    for t in hardware.TARGETS:
        assert re.search(rf"^{re.escape(t.name)}\s", r.stdout, re.M)
    detail = run_cli("targets", "t4")
    assert "bf16      emulated" in detail.stdout and "source:" in detail.stdout
    doc = json.loads(run_cli("targets", "--format", "json").stdout)
    assert {d["name"] for d in doc} == set(hardware.names())
    assert run_cli("targets", "k80").returncode == 2


def _safetensors(path: Path, dtype: str) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(4, 4).to(getattr(torch, dtype)), "fc.bias": torch.zeros(4).to(getattr(torch, dtype))}, str(path))
    return path


def test_scan_target_warns_for_emulated_and_fails_for_unsupported(tmp_path: Path) -> None:
    bf16 = _safetensors(tmp_path / "bf16.safetensors", "bfloat16")
    r = run_cli("scan", str(bf16), "--target", "v100", "--format", "json")
    assert r.returncode == 0, r.stderr
    rules = {f["rule"] for f in json.loads(r.stdout)["checkpoints"][0]["findings"]}
    assert rules == {"emulated-dtype"}
    assert run_cli("scan", str(bf16), "--target", "v100", "--fail-on", "warning").returncode == 1
    assert run_cli("scan", str(bf16), "--target", "a100").returncode == 0
    fp8 = _safetensors(tmp_path / "fp8.safetensors", "float8_e4m3fn")
    r = run_cli("scan", str(fp8), "--target", "t4", "--format", "json")
    assert r.returncode == 1
    found = json.loads(r.stdout)["checkpoints"][0]["findings"]
    assert {f["rule"] for f in found} == {"unsupported-dtype"} and {f["tensor"] for f in found} == {"fc.weight", "fc.bias"}
    assert run_cli("scan", str(fp8), "--target", "h100").returncode == 0
    bad = run_cli("scan", str(fp8), "--target", "k80")
    assert bad.returncode == 2 and "unknown target 'k80'" in bad.stderr


def test_convert_dry_run_checks_the_planned_output(tmp_path: Path) -> None:
    source = ROOT / "sample_models" / "cnn_fp32.pt"
    r = run_cli("convert", str(source), "--to", "bf16", "--dry-run", "--target", "t4")
    assert r.returncode == 0, r.stderr
    assert "warning: emulated-dtype: 8 tensors" in r.stdout
    r = run_cli("convert", str(source), "--to", "fp16", "--dry-run", "--target", "t4", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["hardware_target"]["findings"] == []
    r = run_cli("convert", str(source), "--to", "fp16", "--dry-run", "--target", "cpu")
    assert "emulated-dtype" in r.stdout and r.returncode == 0
    assert run_cli("convert", str(source), "--to", "fp16", "--target", "t4", "-o", str(tmp_path / "o.pt")).returncode == 2
    assert not (tmp_path / "o.pt").exists()


def test_plan_report_fails_a_plan_the_target_cannot_run() -> None:
    planned = _inv(("w", "float64"), ("b", "float32"))
    text, unfit = hardware.plan_report("plan: x\n", planned, hardware.resolve("mps"))
    assert unfit and "error: unsupported-dtype: 1 tensor (w): float64 cannot be computed on mps" in text
    section, unfit = hardware.plan_json(planned, hardware.resolve("h100"))
    assert not unfit and section == {"name": "h100", "device": hardware.resolve("h100").label, "findings": []}


def test_policy_target_holds_every_checkpoint_to_the_device(tmp_path: Path) -> None:
    from dtypeaudit import load_policy
    from dtypeaudit.checks import check
    from dtypeaudit.errors import PolicyError

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("version: 1\nextends: bf16\ntarget: V100\n")
    policy = load_policy(str(deploy))
    assert policy.target == "v100"
    assert [f.rule for f in check(_inv(("w", "bfloat16")), policy)] == ["emulated-dtype"]
    child = tmp_path / "child.yaml"
    child.write_text("version: 1\nextends: deploy.yaml\n")
    assert load_policy(str(child)).target == "v100"
    bf16 = _safetensors(tmp_path / "bf16.safetensors", "bfloat16")
    r = run_cli("scan", str(bf16), "--policy", str(deploy), "--format", "json")
    assert r.returncode == 0 and {f["rule"] for f in json.loads(r.stdout)["checkpoints"][0]["findings"]} == {"emulated-dtype"}
    r = run_cli("scan", str(bf16), "--policy", str(deploy), "--target", "a100", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["checkpoints"][0]["findings"] == []  # --target replaces the policy's
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ntarget: k80\n")
    with pytest.raises(PolicyError, match=r"bad.yaml:2: unknown target 'k80' \(valid: cpu, cpu-avx512bf16"):
        load_policy(str(bad))


def _rules_of(findings: list[dict[str, object]]) -> list[tuple[object, object]]:
    return sorted((f["rule"], f["tensor"]) for f in findings)


def test_convert_target_replaces_the_policys_target_as_scan_does(tmp_path: Path) -> None:
    """A policy saying `target: v100` and `--target h100`: the plan is held to h100 alone, as a scan of its output is
    (the v100 findings were the plan's too, before). Without --target the policy's v100 holds both alike."""
    source = _safetensors(tmp_path / "fp32.safetensors", "float32")
    output = _safetensors(tmp_path / "bf16.safetensors", "bfloat16")  # what the plan makes, written for scan
    policy = tmp_path / "v100.yaml"
    policy.write_text("version: 1\nextends: bf16\ntarget: v100\n")
    emulated = [("emulated-dtype", "fc.bias"), ("emulated-dtype", "fc.weight")]
    for flags, want in (((), emulated), (("--target", "h100"), [])):
        planned = run_cli("convert", str(source), "--to", "bf16", "--dry-run", "--policy", str(policy), "--format", "json", *flags)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        doc = json.loads(planned.stdout)
        scanned = run_cli("scan", str(output), "--policy", str(policy), "--format", "json", *flags)
        assert scanned.returncode == 0, scanned.stdout + scanned.stderr
        (checkpoint,) = json.loads(scanned.stdout)["checkpoints"]
        found = _rules_of(doc["plan_findings"]) + _rules_of(doc.get("hardware_target", {}).get("findings", []))
        assert found == _rules_of(checkpoint["findings"]) == want
        assert ("hardware_target" in doc) == bool(flags)
        if flags:
            assert doc["hardware_target"]["name"] == "h100" and "v100" not in planned.stdout


def test_convert_target_findings_fail_at_the_policys_fail_on_as_scan_does(tmp_path: Path) -> None:
    """`fail_on: warning` in the policy: the target's emulated-dtype warnings fail the plan (exit 1) as they fail a
    scan of the output; at the default fail_on they do not."""
    source = _safetensors(tmp_path / "fp32.safetensors", "float32")
    output = _safetensors(tmp_path / "bf16.safetensors", "bfloat16")
    for fail_on, code in (("warning", 1), ("error", 0)):
        policy = tmp_path / f"{fail_on}.yaml"
        policy.write_text(f"version: 1\nextends: bf16\nfail_on: {fail_on}\n")
        planned = run_cli("convert", str(source), "--to", "bf16", "--dry-run", "--policy", str(policy), "--target", "v100")
        scanned = run_cli("scan", str(output), "--policy", str(policy), "--target", "v100")
        assert (planned.returncode, scanned.returncode) == (code, code), planned.stdout + scanned.stdout
        assert "warning: emulated-dtype: 2 tensors (" in planned.stdout
