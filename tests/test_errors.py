"""Exit codes for what went wrong: 2 for the user's input, 3 for dtypeaudit's own bug, and verdicts apart from both."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import dtypeaudit
from dtypeaudit import cli, exitcodes, pipeline
from dtypeaudit.errors import DtypeAuditError
from dtypeaudit.live import AuditFailed

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
SAMPLE = str(ROOT / "sample_models" / "cnn_fp32.pt")


def test_a_bug_of_ours_exits_3_with_the_version_and_a_request_to_report_it(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a key our code forgot")

    # A genuine bug in our own code path, placed where the scan pipeline reads a target.
    monkeypatch.setattr(pipeline, "read_target", broken)
    result = CliRunner().invoke(cli.app, ["scan", SAMPLE, "-f", "json"])
    assert result.exit_code == exitcodes.INTERNAL == 3
    assert "internal error: KeyError" in result.stderr
    assert f"dtypeaudit {dtypeaudit.__version__}" in result.stderr and "bug in dtypeaudit" in result.stderr
    assert result.stdout == ""


def test_an_unreadable_input_is_still_exit_2_not_3(tmp_path):
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    result = CliRunner().invoke(cli.app, ["scan", str(bad), "-f", "json"])
    assert result.exit_code == exitcodes.ERROR == 2
    assert "internal error" not in result.stderr


def test_debug_shows_the_traceback_of_our_bug(monkeypatch):
    monkeypatch.setattr(pipeline, "read_target", lambda *a, **k: {}["missing"])
    result = CliRunner().invoke(cli.app, ["scan", SAMPLE, "--debug"])
    assert isinstance(result.exception, KeyError)


def test_a_failed_audit_is_a_verdict_not_an_input_error():
    assert not issubclass(AuditFailed, DtypeAuditError)
    assert issubclass(AuditFailed, AssertionError)
    with pytest.raises(AssertionError, match="broken model"):
        raise AuditFailed([], title="broken model")


def test_the_help_lists_exit_code_3():
    result = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "200"})
    assert "3 internal error" in result.stdout
