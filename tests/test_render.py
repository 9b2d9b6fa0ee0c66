"""Every renderer: golden files over the shipped samples, SARIF against the official schema, JUnit parsed back."""

from __future__ import annotations

import json
import os
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

from .helpers import ROOT

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
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(text)
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
