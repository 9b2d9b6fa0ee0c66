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
    assert result.exit_code == 3
    assert "Traceback" in result.stderr and "KeyError: 'missing'" in result.stderr and "internal error" in result.stderr


def test_a_failed_audit_is_a_verdict_not_an_input_error():
    assert not issubclass(AuditFailed, DtypeAuditError)
    assert issubclass(AuditFailed, AssertionError)
    with pytest.raises(AssertionError, match="broken model"):
        raise AuditFailed([], title="broken model")


def test_the_help_lists_exit_code_3():
    result = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "200"})
    assert "3 internal error" in result.stdout


# -- an error is never changed once raised: a caller that knows the path raises a new one from it ------------------


def _rebuilt_from_a_string(path):
    """A pickle whose tensor is rebuilt from a string, not a storage record: the reader's error names no file."""
    import collections
    import pickle

    import torch

    class Bad:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, ("not a storage", 0, (2,), (1,), False, collections.OrderedDict()))

    path.write_bytes(pickle.dumps({"w": Bad()}, protocol=2))
    return path


def test_a_readers_error_gets_its_path_on_a_new_error_and_says_the_same(tmp_path):
    from dtypeaudit.errors import CheckpointError
    from dtypeaudit.formats import read_checkpoint

    bad = _rebuilt_from_a_string(tmp_path / "bad.pkl")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(bad)
    err, original = caught.value, caught.value.__cause__
    assert type(err) is CheckpointError and type(original) is CheckpointError and err is not original
    assert err.one_line() == f"{bad}: a tensor is rebuilt from something that is not a storage record"
    assert original.path is None  # what the reader raised is as it raised it
    assert original.one_line() == "a tensor is rebuilt from something that is not a storage record"
    # and the line users see is the same one
    result = CliRunner().invoke(cli.app, ["scan", str(bad), "-f", "json"])
    assert result.exit_code == 2
    assert f"dtypeaudit: error: {bad}: a tensor is rebuilt from something that is not a storage record" in result.stderr


def test_a_hub_id_not_cached_is_a_new_error_with_the_same_line(tmp_path, monkeypatch):
    from dtypeaudit.errors import CheckpointError

    monkeypatch.chdir(tmp_path)  # no local org/absent
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as caught:
        pipeline.read_target("org/absent")
    err, original = caught.value, caught.value.__cause__
    why = f"the Hugging Face cache ({tmp_path / 'hub'}) holds no snapshot of it, and HF_HUB_OFFLINE=1 forbids asking the hub"
    hint = "download it first: hf download org/absent"
    assert err.one_line() == f"org/absent: no such local path; as a Hugging Face hub id: {why} ({hint})"
    assert type(original) is CheckpointError and original is not err
    assert (original.path, original.message, original.hint) == ("hf://org/absent", why, hint)  # unchanged by the caller


def test_naming_copies_a_subclass_that_takes_other_arguments():
    from dtypeaudit.trace.record import TraceStopped

    first = TraceStopped("boom", module="encoder.0", op="aten.mm")
    again = first.naming("model.py", message="something else")
    assert type(again) is TraceStopped and again is not first
    assert (again.path, again.message) == ("model.py", "something else")
    assert (again.module, again.op, again.reason) == ("encoder.0", "aten.mm", "boom")
    assert str(again) == "model.py: something else" and again.args == ("something else",)
    assert (first.path, first.message) == (None, "tracing stopped in module 'encoder.0': aten.mm: boom")
