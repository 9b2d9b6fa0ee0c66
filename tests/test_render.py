"""Every renderer: golden files over the shipped samples, SARIF against the official schema, JUnit parsed back."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dtypeaudit import __version__
from dtypeaudit.checks import checks_for
from dtypeaudit.cli import default_format
from dtypeaudit.inventory import Report
from dtypeaudit.pipeline import scan
from dtypeaudit.policy import load_policy
from dtypeaudit.render import OutputFormat, renderer_for

from .helpers import ROOT, run_cli

GOLDEN = Path(__file__).parent / "golden"
SUFFIX = {
    "table": "txt",
    "plain": "txt",
    "json": "json",
    "sarif": "sarif",
    "github": "txt",
    "junit": "xml",
    "markdown": "md",
    "html": "html",
}


@pytest.fixture(scope="module")
def sample_report() -> Report:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return scan(
            ["sample_models/cnn_half_converted.pt", "sample_models/cnn_fp32.pt", "sample_models/missing.pt"],
            checks=checks_for(load_policy("fp16-mixed")),
            policy_name="fp16-mixed",
            jobs=1,
        )
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_golden(fmt: OutputFormat, sample_report: Report) -> None:
    text = renderer_for(fmt, width=120)(sample_report).replace(__version__, "VERSION")
    golden = GOLDEN / f"report.{fmt.value}.{SUFFIX[fmt.value]}"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"{golden} is missing: run with UPDATE_GOLDEN=1 to write it, and review what it holds"
    assert text == golden.read_text()


def test_every_format_has_a_renderer() -> None:
    for fmt in OutputFormat:
        assert callable(renderer_for(fmt))


def test_sarif_is_valid_against_the_official_schema(sample_report: Report) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parent / "sarif-schema-2.1.0.json").read_text())
    doc = json.loads(renderer_for(OutputFormat.sarif)(sample_report))
    jsonschema.validate(doc, schema)
    run = doc["runs"][0]
    results = run["results"]
    assert len(results) == len(sample_report.findings) + 1  # + the unreadable checkpoint
    rule_ids = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert all(rule_ids[r["ruleIndex"]] == r["ruleId"] for r in results)
    mix = next(r for r in results if r["ruleId"] == "module-dtype-mix")
    assert mix["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "sample_models/cnn_half_converted.pt"
    assert mix["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == "model.fc"
    assert run["invocations"][0]["executionSuccessful"] is False


def test_junit_parses_back(sample_report: Report) -> None:
    root = ET.fromstring(renderer_for(OutputFormat.junit)(sample_report))
    suite = root.find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "2", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["sample_models/cnn_half_converted.pt"].find("failure") is not None
    assert cases["sample_models/missing.pt"].find("error") is not None


def test_github_annotations(sample_report: Report) -> None:
    lines = renderer_for(OutputFormat.github)(sample_report).splitlines()
    assert any(line.startswith("::error file=sample_models/missing.pt,title=dtypeaudit unreadable::") for line in lines)
    assert any(
        line.startswith("::error file=sample_models/cnn_half_converted.pt,title=dtypeaudit module-dtype-mix::model.fc: ") for line in lines
    )


def test_default_format_follows_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert default_format(Tty()) is OutputFormat.table
    assert default_format(object()) is OutputFormat.plain
    monkeypatch.setenv("NO_COLOR", "1")
    assert default_format(Tty()) is OutputFormat.plain
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert default_format(Tty()) is OutputFormat.plain


# -- -f plain: the terminal's report without colour ----------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 100, 120, 200])
@pytest.mark.parametrize("verbose", [False, True])
def test_plain_report_is_the_table_without_colour(sample_report: Report, width: int, verbose: bool) -> None:
    """-f plain shows what -f table shows, character for character, without ANSI and without trailing blanks, each
    line within the width."""
    plain_text = renderer_for(OutputFormat.plain, width=width, verbose=verbose)(sample_report)
    table = renderer_for(OutputFormat.table, width=width, verbose=verbose)(sample_report)
    assert "\x1b[" in table and "\x1b" not in plain_text
    assert plain_text == "".join(line.rstrip() + "\n" for line in re.sub(r"\x1b\[[0-9;]*m", "", table).splitlines())
    assert "─" * 40 in plain_text and "Findings" in plain_text
    assert all(line == line.rstrip() and len(line) <= width for line in plain_text.splitlines())


@pytest.mark.parametrize("fail_on", ["info", "warning", "error"])
def test_every_verdict_is_the_reports_own_failing(fail_on: str) -> None:
    """Markdown, HTML, JUnit, the text report, the trace verdict and the exit code all say what Report.failing says:
    a warning and an info finding fail at info, the warning alone at warning, nothing at error."""
    from dataclasses import replace

    from dtypeaudit import exitcodes
    from dtypeaudit.formats import read_checkpoint
    from dtypeaudit.inventory import CheckpointReport, Finding
    from dtypeaudit.render import html, junit, markdown
    from dtypeaudit.render import trace as trace_render

    inv = read_checkpoint(str(ROOT / "sample_models" / "cnn_fp32.pt"))
    warned = Finding("dtype-mismatch", "warning", "float32, the policy wants float16", tensor=inv.tensors[0].name)
    told = Finding("config-dtype-mismatch", "info", "only an info", tensor=inv.tensors[1].name)
    base = Report((CheckpointReport(inv.path, inv.format, None, inv, (warned, told)),))
    report = replace(base, fail_on=fail_on)
    expected = {"info": [warned, told], "warning": [warned], "error": []}[fail_on]
    assert report.failing() == expected
    failed = bool(expected)
    assert ("❌ failed" in markdown.render(report)) is failed and ("✅ passed" in markdown.render(report)) is not failed
    assert f'class="verdict verdict-{"failed" if failed else "passed"}"' in html.render(report)
    suite = ET.fromstring(junit.render(report)).find("testsuite")
    assert suite is not None and suite.get("failures") == str(int(failed))
    case = suite.find("testcase")
    assert case is not None
    failure, out = case.find("failure"), case.find("system-out")
    assert (failure.get("message") if failure is not None else None) == (
        f"{len(expected)} finding(s) at or above {fail_on}" if failed else None
    )
    shown_apart = 2 - len(expected)  # the findings below --fail-on go to system-out, each once
    assert (out.text.count("\n") + 1 if out is not None and out.text else 0) == shown_apart
    assert renderer_for(OutputFormat.plain)(report).rstrip().splitlines()[-1].startswith("✗" if failed else "✓")
    assert trace_render.verdict(report).startswith("✗" if failed else "✓")
    assert exitcodes.for_report(report) == (exitcodes.FINDINGS if failed else exitcodes.CLEAN)


def test_annotations_name_the_shard_that_holds_the_tensor(tmp_path: Path) -> None:
    """A folder's finding points at the file that holds its tensor (SARIF's artifact, GitHub's file=), not at the
    folder; findings spread over several files point at the folder."""
    import json as jsonlib

    import torch

    from .helpers import write_sharded

    state = {f"layers.{i}.weight": torch.ones(4, 4, dtype=torch.float16) for i in range(4)}
    state["layers.3.weight"] = torch.ones(4, 4)  # float32, in the second shard
    folder = write_sharded(tmp_path / "model", state, 2)
    shard = f"{folder}/model-00002-of-00002.safetensors"
    github = run_cli("scan", str(folder), "--preset", "fp16", "-f", "github")
    assert github.returncode == 1
    # config.json says float32, so from_pretrained loads every tensor as float32: three mismatch in both shards
    # (one annotation, on the folder), layers.3.weight in the second shard alone (one, on that shard)
    lines = sorted(x for x in github.stdout.splitlines() if "title=dtypeaudit dtype-mismatch" in x)
    assert [x.split(",", 1)[0] for x in lines] == [f"::error file={folder}", f"::error file={shard}"]
    assert "layers.3.weight" in lines[1] and "layers.3.weight" not in lines[0]
    sarif = jsonlib.loads(run_cli("scan", str(folder), "--preset", "fp16", "-f", "sarif").stdout)
    results = [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "dtype-mismatch"]
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results}
    assert uris == {Path(f"{folder}/model-0000{i}-of-00002.safetensors").as_uri() for i in (1, 2)}
