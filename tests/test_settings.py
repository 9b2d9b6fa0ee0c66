"""A run's settings are resolved and checked once, before any checkpoint byte is read (options.py): a misuse is
exit 2 with its own line, and the checkpoint is never opened; the Python API takes the same settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dtypeaudit
from dtypeaudit.errors import PolicyError, UsageError
from dtypeaudit.options import convert_settings, effective, strict_for

from .helpers import run_cli

_WATCHED: set[str] = set()
_OPENED: list[str] = []


def _record_opens(event: str, args: tuple[object, ...]) -> None:
    # installed once for the process (an audit hook cannot be removed): it notes opens of watched paths only
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, Path)):
        name = str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode()).resolve())
        if any(name == w or name.startswith(w + "/") for w in _WATCHED):
            _OPENED.append(name)


sys.addaudithook(_record_opens)


@pytest.fixture
def watched(tmp_path: Path) -> Path:
    """A real torch.save checkpoint whose every open is recorded."""
    path = tmp_path / "model.pt"
    torch.save({"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4)}, path)
    _WATCHED.add(str(path.resolve()))
    _OPENED.clear()
    yield path
    _WATCHED.clear()


CONVERT_MISUSES = [
    (["--to", "int8"], "--to must be fp16, bf16 or fp32"),
    (["--to", "fp16", "--preset", "no-such-preset"], "no-such-preset"),
    (["--to", "fp16", "--policy", "/nonexistent/policy.yaml"], "policy.yaml"),
    (["--to", "fp16", "--policy", "/nonexistent/policy.yaml", "--preset", "fp16"], "not both"),
    (["--to", "fp16", "--include-optimizer", "--strip-optimizer"], "contradict each other"),
    (["--to", "fp16", "--in-place", "-o", "x.pt"], "--in-place or --output"),
    (["--to", "fp16", "--check-values"], "give --dry-run too"),
    (["--to", "fp16", "--target", "t4"], "give --dry-run too"),
    (["--to", "fp16", "--dry-run", "--target", "no-such-gpu"], "no-such-gpu"),
    (["--to", "fp16", "--max-shard-size", "5 parsecs"], "--max-shard-size"),
    (["--to", "fp16", "--max-shard-size", "5GB"], "applies to Hugging Face directories"),
]


@pytest.mark.parametrize(("options", "says"), CONVERT_MISUSES, ids=[" ".join(o) for o, _ in CONVERT_MISUSES])
def test_a_convert_misuse_is_exit_2_before_the_checkpoint_is_opened(watched: Path, options: list[str], says: str) -> None:
    proc = run_cli("convert", str(watched), *options)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and proc.stderr.count("\n") == 1
    assert _OPENED == []
    proc = run_cli("convert", str(watched), "--to", "fp16")  # the recorder sees a real conversion open it
    assert proc.returncode == 0 and _OPENED


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--preset", "no-such-preset"], "no-such-preset"),
        (["--fail-on", "fatal"], "--fail-on must be"),
        (["--quiet", "--verbose"], "--quiet or --verbose"),
        (["--include-optimizer"], "applies to --values"),
        (["--target", "no-such-gpu"], "no-such-gpu"),
    ],
)
def test_a_scan_misuse_is_exit_2_before_the_checkpoint_is_opened(watched: Path, options: list[str], says: str) -> None:
    proc = run_cli("scan", str(watched), *options)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert _OPENED == []


def test_the_option_error_wins_over_a_missing_checkpoint(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pt")
    proc = run_cli("convert", missing, "--to", "fp16", "--include-optimizer", "--strip-optimizer")
    assert proc.returncode == 2 and "contradict" in proc.stderr and "missing.pt" not in proc.stderr
    proc = run_cli("scan", missing, "--preset", "no-such-preset")
    assert proc.returncode == 2 and "no-such-preset" in proc.stderr
    # the other way round: good options, a missing checkpoint, and the checkpoint's error
    proc = run_cli("convert", missing, "--to", "fp16")
    assert proc.returncode == 2 and "missing.pt" in proc.stderr


def test_strict_is_decided_once(tmp_path: Path) -> None:
    strict_file = tmp_path / "strict.yaml"
    strict_file.write_text("version: 1\nstrict: true\ndefault: float32\n")
    strict = dtypeaudit.load_policy(str(strict_file))
    assert strict_for(None) is False and strict_for(None, True) is True and strict_for(strict) is True
    assert effective(str(strict_file)).strict and not effective("fp16").strict and effective("fp16", strict=True).strict
    assert convert_settings("fp16", policy=str(strict_file)).strict
    assert not convert_settings("fp16").strict and convert_settings("fp16", strict=True).strict


def test_the_library_takes_the_settings(watched: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="contradict"):
        convert_settings("fp16", include_optimizer=True, strip_optimizer=True)
    with pytest.raises(PolicyError):
        convert_settings("fp16", policy="/nonexistent/policy.yaml")
    assert _OPENED == []
    settings = dtypeaudit.convert_settings("bf16", dry_run=True, read_values=False)
    assert settings.to == "bfloat16" and not settings.read_values
    assert convert_settings("fp16").read_values and convert_settings("fp16", dry_run=True).read_values
    result = dtypeaudit.convert(watched, settings=dtypeaudit.convert_settings("fp16"), output=tmp_path / "out.pt")
    assert result.output == tmp_path / "out.pt"
    assert {t.dtype for t in dtypeaudit.read(tmp_path / "out.pt").tensors} == {"float16"}
    with pytest.raises(TypeError):
        dtypeaudit.convert(watched, "fp16", settings=settings)
    report = dtypeaudit.scan([str(tmp_path / "out.pt")], settings=dtypeaudit.scan_settings(preset="fp32"))
    assert {f.rule for f in report.findings} == {"dtype-mismatch"} and report.fail_on == "error"
