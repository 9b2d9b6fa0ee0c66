"""What people and gates read: encodings, narrow terminals, NO_COLOR, --help, --quiet, findings grouped by cause."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import dtypeaudit

from .helpers import ROOT, run_cli

SAMPLES = ["sample_models/cnn_half_converted.pt", "sample_models/cnn_fp32.pt", "sample_models/block_bf16.safetensors"]


@pytest.mark.parametrize("fmt", ["plain", "markdown"])
@pytest.mark.parametrize("encoding", ["cp1252", "ascii"])
def test_a_console_that_cannot_show_unicode_gets_ascii(fmt: str, encoding: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dtypeaudit", "scan", "sample_models/", "-f", fmt],
        capture_output=True,
        cwd=ROOT,
        env={**_env(), "PYTHONIOENCODING": encoding},
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr  # cnn_half_converted.pt has an error finding; not 2 (our crash)
    text = proc.stdout.decode("ascii")  # nothing outside ASCII reached the console
    if fmt == "plain":
        assert text.rstrip().splitlines()[-1] == "FAIL 3 checkpoints: 1 error (failing at --fail-on error)"
        assert "sample_models/block_bf16.safetensors  safetensors  13 tensors - 4.3K elements - 8.4 KiB" in text
    else:
        assert "**failed**: 3 checkpoint(s)" in text
    assert b"UnicodeEncodeError" not in proc.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", "PYTHONPATH": str(ROOT)}


LONG_KEY = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1}"


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder_attention_projection_layers = nn.ModuleList(
            nn.ModuleDict({"query_key_value_projection": nn.Linear(2, 2), "post_attention_layernorm": nn.LayerNorm(2)}) for _ in range(2)
        )


@pytest.fixture(scope="module")
def long_names(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("names") / "long.pt"
    state = {"model": _Deep().state_dict(), "callbacks": {LONG_KEY: {"kth_value": torch.tensor(float("inf"))}}}
    torch.save(state, path)
    names = [f"model.{k}" for k in state["model"]] + [f"callbacks.{LONG_KEY}.kth_value"]
    return path, names


@pytest.mark.parametrize("columns", ["80", "100"])
def test_tensor_names_break_only_after_a_dot_or_a_space(long_names: tuple[Path, list[str]], columns: str) -> None:
    path, names = long_names
    proc = run_cli("scan", str(path), "-f", "plain", env={"COLUMNS": columns})
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("name ")))
    dtype_at = lines[header].index("dtype")
    rows: list[list[str]] = []
    for line in lines[header + 2 :]:
        if not line.strip() or line.startswith(("✓", "✗")):
            break
        assert len(line) <= int(columns)
        name, rest = line[:dtype_at].rstrip(), line[dtype_at:].strip()
        if rest:
            rows.append([name])
        else:
            rows[-1].append(name)
    seen = []
    for pieces in rows:
        for piece in pieces[:-1]:
            assert piece.endswith((".", ",", ":")), pieces  # the break is after a dot (or between words of a key)
        seen.append("".join(p if p.endswith(".") else p + " " for p in pieces[:-1]) + pieces[-1])
    assert seen == names
    assert any(len(pieces) > 1 for pieces in rows)  # the narrow terminal did make names wrap


def test_findings_name_column_keeps_components_whole(long_names: tuple[Path, list[str]]) -> None:
    path, names = long_names
    proc = run_cli("scan", str(path), "--preset", "fp16", "-f", "plain", "--verbose", env={"COLUMNS": "80"})
    assert proc.returncode == 1
    findings = proc.stdout[proc.stdout.index("Findings") : proc.stdout.index("By dtype")]
    words = set(re.findall(r"[A-Za-z_]{4,}", findings))
    for component in ("encoder_attention_projection_layers", "query_key_value_projection", "post_attention_layernorm"):
        assert component in words  # never cut in two


def test_no_color_table_and_plain_trailing_spaces() -> None:
    colored = run_cli("scan", *SAMPLES, "-f", "table", env={"NO_COLOR": ""}, cwd=ROOT)
    assert "\x1b[" in colored.stdout  # the control: a table is coloured by default
    plain_table = run_cli("scan", *SAMPLES, "-f", "table", env={"NO_COLOR": "1"}, cwd=ROOT)
    assert "\x1b" not in plain_table.stdout and plain_table.returncode == 1
    for proc in (plain_table, run_cli("scan", *SAMPLES, "-f", "plain", cwd=ROOT)):
        assert [line for line in proc.stdout.splitlines() if line != line.rstrip()] == []


def test_help_rewraps_paragraphs_and_shows_brackets() -> None:
    scan_help = run_cli("scan", "--help", env={"COLUMNS": "100"}).stdout
    assert "pip install 'dtypeaudit[dask]'" in " ".join(scan_help.split())
    convert_help = run_cli("convert", "--help", env={"COLUMNS": "100"}).stdout
    description = convert_help[: convert_help.index("Examples:")].split("\n\n")[1:]
    for paragraph in description:
        lines = paragraph.splitlines()
        assert all(len(line) > 60 for line in lines[:-1]), lines  # rewrapped: no short line mid-paragraph
    for text in (scan_help, convert_help):
        assert [line for line in text.splitlines() if line != line.rstrip()] == []
    assert "│" not in convert_help and "\\b" not in convert_help
    assert [line for line in convert_help.splitlines() if re.search(r"\w-$", line)] == []  # never --keep-/unsafe


def test_an_unreadable_input_is_reported_once(tmp_path: Path) -> None:
    import pty

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"")
    # On a terminal, the report says it and stderr stays quiet.
    leader, follower = pty.openpty()
    proc = subprocess.run(
        [sys.executable, "-m", "dtypeaudit", "scan", str(bad), "-f", "plain"],
        stdout=follower,
        stderr=subprocess.PIPE,
        env={**_env(), "COLUMNS": "100"},
        timeout=300,
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.returncode == 2
    assert shown.decode().count("empty file") == 1 and proc.stderr == b""
    # Piped: the report on stdout, and the one-line log on stderr for whoever reads the terminal or greps the log.
    piped = run_cli("scan", str(bad), "-f", "plain")
    assert piped.returncode == 2 and piped.stdout.count("empty file") == 1
    assert len(piped.stderr.splitlines()) == 1 and "empty file" in piped.stderr
    machine = run_cli("scan", str(bad), "-f", "json")
    assert machine.returncode == 2 and json.loads(machine.stdout)["checkpoints"][0]["error"]
    assert len(machine.stderr.splitlines()) == 1 and "empty file" in machine.stderr


# -- findings grouped by cause ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3)
        self.act = nn.ReLU()


class Whole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.fc = nn.Linear(3, 2)


@pytest.fixture(scope="module")
def whole_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whole") / "whole.pt"
    torch.save(Whole(), path)
    return path


CLASSES = 6  # Whole, Sequential, Block, Conv2d, ReLU, Linear


def test_a_whole_model_save_is_one_finding_per_cause(whole_model: Path) -> None:
    doc = json.loads(run_cli("scan", str(whole_model), "-f", "json").stdout)
    rules = [f["rule"] for f in doc["checkpoints"][0]["findings"]]
    assert rules.count("unsafe-global") == CLASSES and rules.count("pickled-module") == CLASSES  # JSON keeps each one
    proc = run_cli("scan", str(whole_model), "-f", "plain", "--quiet")
    assert proc.returncode == 1
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("error", "warning", "info"))]
    assert len(rows) == 1 and rows[0].split()[:3] == ["error", "pickled-module", f"×{CLASSES}"]
    assert "each also unsafe-global" in " ".join(proc.stdout.split())
    assert "and 3 more" in proc.stdout  # the first names, then the count


def test_github_annotations_are_one_per_cause(whole_model: Path) -> None:
    proc = run_cli("scan", *SAMPLES, str(whole_model), "--preset", "fp16", "-f", "github", cwd=ROOT)
    assert proc.returncode == 1
    annotations = [line for line in proc.stdout.splitlines() if line.startswith("::")]
    doc = json.loads(run_cli("scan", *SAMPLES, str(whole_model), "--preset", "fp16", "-f", "json", cwd=ROOT).stdout)
    total = sum(len(c["findings"]) for c in doc["checkpoints"])
    causes = {(c["path"], f["rule"], f["message"]) for c in doc["checkpoints"] for f in c["findings"] if f["rule"] != "unsafe-global"}
    assert total > 40 and len(annotations) == len({(p, r, m) for p, r, m in causes if r != "pickled-module"}) + 1
    mismatch = next(a for a in annotations if "cnn_fp32.pt" in a and "dtype-mismatch" in a)
    assert re.search(
        r"title=dtypeaudit dtype-mismatch \(8\)::conv\.weight, conv\.bias, bn\.weight and 5 more: is float32, expected float16", mismatch
    )


def test_quiet_is_findings_only_and_the_hooks_default() -> None:
    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    entry = shlex.split(hook["entry"])
    assert "--quiet" in entry
    clean = run_cli(*entry[1:], "sample_models/cnn_fp32.pt", "sample_models/block_bf16.safetensors", cwd=ROOT)
    assert clean.returncode == 0 and clean.stdout.splitlines() == ["✓ 2 checkpoints: no findings"]
    failing = run_cli(*entry[1:], "--preset", "fp16", "sample_models/cnn_fp32.pt", "sample_models/block_bf16.safetensors", cwd=ROOT)
    assert failing.returncode == 1 and "dtype-mismatch" in failing.stdout
    assert "Tensors" not in failing.stdout and "By dtype" not in failing.stdout and len(failing.stdout.splitlines()) < 25
    markdown = run_cli("scan", *SAMPLES, "--quiet", "-f", "markdown", cwd=ROOT)
    assert "| dtype |" not in markdown.stdout and "cnn_half_converted.pt" in markdown.stdout and "cnn_fp32.pt" not in markdown.stdout
    assert run_cli("scan", *SAMPLES, "--quiet", "--verbose").returncode == 2


def test_audit_groups_findings_that_share_a_cause() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(torch.bfloat16)
    found = dtypeaudit.audit(model, target="t4")
    assert [(f.rule, f.tensor) for f in found] == [("emulated-dtype", n) for n in model.state_dict()]  # every finding kept
    (group,) = found.groups
    assert (group.rule, group.count, group.places()) == ("emulated-dtype", 6, "0.weight, 0.bias, 1.weight and 3 more")
    assert "emulated-dtype ×6" in str(found) and "×6" in repr(found)
    assert dtypeaudit.audit(nn.Linear(2, 2), target="t4") == []
