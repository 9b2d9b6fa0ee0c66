"""--strict and `strict: true`: what a loader might read differently from dtypeaudit fails a security gate.

Every file here is written at test time with torch.save or pickle.dumps of our own objects.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

import dtypeaudit
from dtypeaudit.checks import STRICT_MARKER, STRICT_RULES, check, strict_findings
from dtypeaudit.inventory import Finding, Inventory, TensorRecord

from .helpers import json_report, run_cli
from .hostile import rewrite_zip, torch_zip_bytes

# -- the promotion itself --------------------------------------------------------------------------


def test_strict_rules_are_the_loader_differentials() -> None:
    assert STRICT_RULES == {"loader-divergence", "foreign-global", "trailing-data", "unused-weights"}


@pytest.mark.parametrize(
    ("rule", "severity"),
    [("loader-divergence", "info"), ("foreign-global", "warning"), ("trailing-data", "warning"), ("unused-weights", "warning")],
)
def test_each_strict_rule_becomes_an_error_and_keeps_its_message(rule: str, severity: str) -> None:
    f = Finding(rule, severity, "something a loader reads otherwise", tensor="w", file="shard.bin")  # type: ignore[arg-type]
    (got,) = strict_findings([f])
    assert got.severity == "error"
    assert got.message == f.message + STRICT_MARKER and got.message.startswith(f.message)
    assert (got.rule, got.tensor, got.file) == (rule, "w", "shard.bin")


def test_other_findings_are_left_alone() -> None:
    others = [
        Finding("dtype-mismatch", "warning", "is float32, expected float16", tensor="w"),
        Finding("config-dtype-mismatch", "warning", "config.json says float16"),
        Finding("fp16-subnormal", "info", "subnormal"),
        Finding("unsafe-global", "error", "calls posix.system"),
        Finding("trailing-data", "error", "already an error: no marker added"),
    ]
    assert strict_findings(others) == others


def test_check_applies_strict() -> None:
    inv = Inventory(
        "x.pt",
        "torch-zip",
        (TensorRecord("w", "float32", (2,), 8),),
        findings=(Finding("foreign-global", "warning", "references argparse.Namespace"),),
    )
    assert [f.severity for f in check(inv)] == ["warning"]
    assert [f.severity for f in check(inv, strict=True)] == ["error"]


# -- files that produce each rule ------------------------------------------------------------------


def foreign_global_pt(tmp_path: Path) -> Path:
    path = tmp_path / "with_args.pt"
    torch.save({"args": argparse.Namespace(lr=0.1, epochs=3), "w": torch.ones(3)}, path)
    return path


def foreign_global_pickle(tmp_path: Path) -> Path:
    # A bare pickle of a Namespace: pickle.dumps of a tensor is not a torch.save file, so no tensor here.
    path = tmp_path / "args.pkl"
    path.write_bytes(pickle.dumps(argparse.Namespace(lr=0.1), protocol=2))
    return path


def trailing_data_pt(tmp_path: Path) -> Path:
    src = torch_zip_bytes({"w": torch.ones(3)})
    with zipfile.ZipFile(io.BytesIO(src)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data_pkl = z.read(name)
    # A benign second pickle after STOP: torch.load never reads it.
    return rewrite_zip(src, tmp_path / "trailing.pt", replace={name: data_pkl + pickle.dumps({"hidden": 1}, protocol=2)})


def protocol_4_pt(tmp_path: Path) -> Path:
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(3)}, path, pickle_protocol=4)
    return path


def stray_weights_dir(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(3)}, str(d / "model.safetensors"))
    torch.save({"w": torch.zeros(3)}, d / "pytorch_model.bin")  # from_pretrained loads the safetensors file only
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    return d


FIXED = {"foreign-global": [foreign_global_pt, foreign_global_pickle], "trailing-data": [trailing_data_pt]}
MAKERS = [foreign_global_pt, foreign_global_pickle, trailing_data_pt, protocol_4_pt, stray_weights_dir]


def findings(doc: dict) -> list[dict]:
    return [f for c in doc["checkpoints"] for f in c["findings"]]


@pytest.mark.parametrize(("rule", "make"), [(r, m) for r, ms in FIXED.items() for m in ms], ids=lambda x: getattr(x, "__name__", x))
def test_default_passes_and_strict_fails(tmp_path: Path, rule: str, make) -> None:
    path = make(tmp_path)
    code, doc, _ = json_report("scan", str(path))
    assert code == 0, doc
    assert doc["strict"] is False
    assert [f["severity"] for f in findings(doc) if f["rule"] == rule] == ["warning"]

    code, doc, _ = json_report("scan", str(path), "--strict")
    assert code == 1
    assert doc["strict"] is True
    promoted = [f for f in findings(doc) if f["rule"] == rule]
    assert promoted and all(f["severity"] == "error" and f["message"].endswith("(strict)") for f in promoted)

    plain = run_cli("scan", str(path), "--strict", "-f", "plain")
    assert plain.returncode == 1 and rule in plain.stdout and "error" in plain.stdout


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_strict_promotes_exactly_what_the_reader_emits(tmp_path: Path, make) -> None:
    """Whatever the readers say (loader-divergence, unused-weights land with reader changes), strict is the law."""
    path = make(tmp_path)
    code, doc, _ = json_report("scan", str(path))
    strict_code, strict_doc, _ = json_report("scan", str(path), "--strict")
    before, after = findings(doc), findings(strict_doc)
    assert [(f["rule"], f["tensor"], f["file"]) for f in before] == [(f["rule"], f["tensor"], f["file"]) for f in after]
    for b, a in zip(before, after, strict=True):
        if b["rule"] in STRICT_RULES and b["severity"] != "error":
            assert a["severity"] == "error" and a["message"] == b["message"] + STRICT_MARKER
        else:
            assert a == b
    assert strict_code == (1 if any(f["severity"] == "error" for f in after) else code)


def test_sarif_shows_the_promoted_finding_as_error(tmp_path: Path) -> None:
    path = foreign_global_pt(tmp_path)
    default = json.loads(run_cli("scan", str(path), "-f", "sarif").stdout)
    strict = json.loads(run_cli("scan", str(path), "-f", "sarif", "--strict").stdout)
    assert [r["level"] for r in default["runs"][0]["results"] if r["ruleId"] == "foreign-global"] == ["warning"]
    assert [r["level"] for r in strict["runs"][0]["results"] if r["ruleId"] == "foreign-global"] == ["error"]


# -- the policy key --------------------------------------------------------------------------------


def test_policy_strict_true_fails_like_the_flag(tmp_path: Path) -> None:
    path = foreign_global_pt(tmp_path)
    policy = tmp_path / "gate.yaml"
    policy.write_text("version: 1\nstrict: true\n")
    code, doc, _ = json_report("scan", str(path), "--policy", str(policy))
    assert code == 1 and doc["strict"] is True
    assert [f["severity"] for f in findings(doc) if f["rule"] == "foreign-global"] == ["error"]


def test_strict_is_inherited_through_extends(tmp_path: Path) -> None:
    path = foreign_global_pt(tmp_path)
    (tmp_path / "base.yaml").write_text("version: 1\nextends: fp32\nstrict: true\n")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: base.yaml\n")
    (tmp_path / "lenient.yaml").write_text("version: 1\nextends: base.yaml\nstrict: false\n")
    assert dtypeaudit.load_policy(str(tmp_path / "child.yaml")).strict is True
    assert dtypeaudit.load_policy(str(tmp_path / "lenient.yaml")).strict is False
    assert run_cli("scan", str(path), "--policy", str(tmp_path / "child.yaml")).returncode == 1
    assert run_cli("scan", str(path), "--policy", str(tmp_path / "lenient.yaml")).returncode == 0
    # The flag is stronger than a policy's `strict: false`.
    assert run_cli("scan", str(path), "--policy", str(tmp_path / "lenient.yaml"), "--strict").returncode == 1


def test_policy_strict_must_be_a_boolean(tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\ndefault: fp16\nstrict: sometimes\n")
    proc = run_cli("policy", "validate", str(policy))
    assert proc.returncode == 2
    assert f"{policy}:3" in proc.stderr and "strict must be true or false" in proc.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("version: 1\nstrcit: true\n")
    proc = run_cli("policy", "validate", str(typo))
    assert proc.returncode == 2 and "strict" in proc.stderr  # the hint lists the valid keys


def test_policy_validate_says_strict(tmp_path: Path) -> None:
    policy = tmp_path / "gate.yaml"
    policy.write_text("version: 1\nextends: fp16\nstrict: true\n")
    proc = run_cli("policy", "validate", str(policy))
    assert proc.returncode == 0 and "strict" in proc.stdout


def test_policy_init_mentions_strict(tmp_path: Path) -> None:
    path = foreign_global_pt(tmp_path)
    proc = run_cli("policy", "init", str(path))
    assert proc.returncode == 0 and "strict: true" in proc.stdout
    written = tmp_path / "baseline.yaml"
    written.write_text(proc.stdout)
    assert dtypeaudit.load_policy(str(written)).strict is False  # a comment, not a setting


def test_explain_is_unaffected_by_strict(tmp_path: Path) -> None:
    path = foreign_global_pt(tmp_path)
    policy = tmp_path / "gate.yaml"
    policy.write_text("version: 1\nextends: fp32\nstrict: true\n")
    proc = run_cli("scan", str(path), "--policy", str(policy), "--explain", "w")
    assert proc.returncode == 0, proc.stderr
    assert "foreign-global" not in proc.stdout


# -- the library and the help ----------------------------------------------------------------------


def test_library_scan_strict(tmp_path: Path) -> None:
    path = str(trailing_data_pt(tmp_path))
    default = dtypeaudit.scan([path])
    strict = dtypeaudit.scan([path], strict=True)
    assert default.strict is False and strict.strict is True
    assert [f.severity for f in default.findings if f.rule == "trailing-data"] == ["warning"]
    assert [f.severity for f in strict.findings if f.rule == "trailing-data"] == ["error"]


def test_help_teaches_strict() -> None:
    proc = run_cli("scan", "--help", env={"COLUMNS": "200"})
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--strict" in text and "loader might read differently" in text and "security-sensitive gates" in text
