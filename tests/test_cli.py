"""The command line as CI runs it: exit codes, stdout carrying only the report, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import ROOT, json_report, run_cli


def test_json_contract(training_pt: Path) -> None:
    code, doc, err = json_report("scan", str(training_pt))
    assert code == 0 and err == ""
    assert doc["schema"] == "dtypeaudit.report/1"
    (ckpt,) = doc["checkpoints"]
    assert set(ckpt) >= {"path", "format", "error", "tensors", "findings"}
    assert ckpt["error"] is None and ckpt["format"] == "torch-zip"
    tensor = next(t for t in ckpt["tensors"] if t["name"] == "model.conv.weight")
    assert {k: tensor[k] for k in ("dtype", "shape", "kind", "nbytes")} == {
        "dtype": "float32",
        "shape": [4, 3, 3, 3],
        "kind": "unknown",
        "nbytes": 432,
    }
    by_dtype = {row["dtype"]: row for row in ckpt["summary"]["by_dtype"]}
    assert by_dtype["float32"]["tensors"] == sum(1 for t in ckpt["tensors"] if t["dtype"] == "float32")


def test_hostile_file_exits_1_and_never_runs(tmp_path: Path, canary: Path) -> None:
    payload = tmp_path / "evil.pt"
    script = (
        "import os, torch\n"
        "class P:\n"
        f"    def __reduce__(self): return (os.system, ('touch {canary}',))\n"
        f"torch.save({{'w': torch.ones(1), 'p': P()}}, {str(payload)!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    code, doc, _ = json_report("scan", str(payload))
    assert code == 1
    assert not canary.exists()
    (finding,) = doc["checkpoints"][0]["findings"]
    assert finding["rule"] == "unsafe-global" and finding["severity"] == "error" and "posix.system" in finding["message"]


@pytest.mark.parametrize(
    ("content", "keywords"),
    [
        (b"", "empty file"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n", "Git LFS pointer"),
        (b"<!DOCTYPE html><html><body>404</body></html>", "HTML page"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "PNG image"),
        (b"PK\x03\x04" + b"\0" * 20, "truncated zip archive"),
        (os.urandom(64).replace(b"PK", b"pk").replace(b"{", b"[") + b"\x00", "not a checkpoint"),
    ],
    # named by their keywords: an id made of random bytes differs between xdist's workers, which then refuse to run
    ids=["empty file", "Git LFS pointer", "HTML page", "PNG image", "truncated zip archive", "not a checkpoint"],
)
def test_not_a_checkpoint_is_one_line_exit_2(tmp_path: Path, content: bytes, keywords: str) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x00" * 8 + content[8:] if keywords == "not a checkpoint" else content)
    proc = run_cli("scan", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and keywords in lines[0]
    assert "Traceback" not in proc.stderr


def test_worst_result_decides_and_each_is_reported(training_pt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"")
    code, doc, err = json_report("scan", str(training_pt), str(bad))
    assert code == 2
    assert [c["error"] is None for c in doc["checkpoints"]] == [True, False]
    assert "empty file" in doc["checkpoints"][1]["error"]


def test_fail_on_warning(lightning_ckpt: Path) -> None:
    assert run_cli("scan", str(lightning_ckpt), "-f", "json").returncode == 0
    assert run_cli("scan", str(lightning_ckpt), "-f", "json", "--fail-on", "warning").returncode == 1


def test_misuse_exits_2() -> None:
    assert run_cli("scan").returncode == 2
    proc = run_cli("scan", "x.pt", "--fail-on", "severe")
    assert proc.returncode == 2 and "--fail-on must be" in proc.stderr
    assert run_cli("scan", "nope/*.pt").returncode == 2


def test_debug_shows_traceback(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    assert "Traceback" in run_cli("scan", str(path), "--debug").stderr


def test_directory_of_checkpoints(training_pt: Path, hf_dir: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.pt").write_bytes(training_pt.read_bytes())
    (tree / "sub" / "b.pth").write_bytes(training_pt.read_bytes())
    (tree / "notes.txt").write_text("ignored")
    code, doc, _ = json_report("scan", str(tree))
    assert code == 0
    assert [Path(c["path"]).name for c in doc["checkpoints"]] == ["a.pt", "b.pth"]


def test_human_output_reads_well(tied_lm_pt: Path) -> None:
    proc = run_cli("scan", str(tied_lm_pt))
    assert proc.returncode == 0
    out = proc.stdout
    assert "By dtype" in out and "Tensors" in out and "lm_head.weight" in out and "no findings" in out
    assert "\x1b[" not in out  # NO_COLOR and a pipe: plain text


def test_large_model_folds_repeated_layers(tmp_path: Path) -> None:
    state = {f"layers.{i}.{p}": torch.zeros(4, 4) for i in range(40) for p in ("q.weight", "k.weight", "norm.weight")}
    path = tmp_path / "big.pt"
    torch.save(state, path)
    out = run_cli("scan", str(path)).stdout
    assert "layers.{0..39}.q.weight  ×40" in out
    assert len(out.splitlines()) < 30
    verbose = run_cli("scan", str(path), "--verbose").stdout
    assert "layers.39.norm.weight" in verbose


def test_factory_target(tmp_path: Path) -> None:
    script = tmp_path / "net.py"
    script.write_text("from torch import nn\ndef build():\n    return nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))\n")
    code, doc, _ = json_report("scan", f"{script}:build")
    assert code == 0
    assert {t["name"]: (t["kind"], t["module"]) for t in doc["checkpoints"][0]["tensors"]} == {
        "0.weight": ("parameter", "Linear"),
        "0.bias": ("parameter", "Linear"),
        "1.weight": ("parameter", "LayerNorm"),
        "1.bias": ("parameter", "LayerNorm"),
    }


def test_model_option_attaches_kinds(lightning_ckpt: Path) -> None:
    code, doc, _ = json_report("scan", str(lightning_ckpt), "--model", "tests.models:LitModule", env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert code == 0
    by = {t["name"]: t for t in doc["checkpoints"][0]["tensors"]}
    assert (by["state_dict.net.bn.running_mean"]["kind"], by["state_dict.net.bn.running_mean"]["module"]) == ("buffer", "BatchNorm2d")


def test_report_to_file(training_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = run_cli("scan", str(training_pt), "-f", "json", "-o", str(out))
    assert proc.returncode == 0 and proc.stdout == ""
    assert json.loads(out.read_text())["schema"] == "dtypeaudit.report/1"


@pytest.mark.parametrize(
    "fixture", ["all_dtypes_pt", "safetensors_file", "hf_dir", "legacy_pt", "torchscript_pt", "dcp_dir", "lightning_ckpt"]
)
def test_scans_never_import_torch(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    code = (
        "import sys\n"
        "from dtypeaudit.cli import main\n"
        f"sys.argv = ['dtypeaudit', 'scan', {str(path)!r}, '-f', 'json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.stderr.write(f'rc={rc}')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr.endswith("rc=0"), proc.stderr


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("dtypeaudit ")


def test_several_sources_exit_with_the_worst_and_each_is_converted_or_refused(tmp_path: Path) -> None:
    """A refusal (2) outweighs a clean conversion (0); both reports come back, in the order given."""
    clean, whole = tmp_path / "clean.pt", tmp_path / "linear.pt"
    torch.save({"fc.weight": torch.ones(2, 2)}, clean)
    torch.save(torch.nn.Linear(3, 2), whole)  # a pickled module is code: refused
    proc = run_cli("convert", str(clean), str(whole), "--to", "fp16", "-f", "json")
    assert proc.returncode == 2, proc.stderr
    assert [(d["source"], d["refused"]) for d in json.loads(proc.stdout)] == [(str(clean), False), (str(whole), True)]
    assert (tmp_path / "clean.fp16.pt").exists() and not (tmp_path / "linear.fp16.pt").exists()
    assert "refusing to convert" in proc.stderr
    single = run_cli("convert", str(whole), "--to", "fp16")
    assert single.returncode == 2 and "nothing was written" in single.stdout
