"""The light interpreter (cli_parse.py) against Click's own parse of the same line (Typer's scan command, built
from the same table): for every command line it either declines (Typer answers) or gives the scan body exactly
the values Typer gives it. Lines are generated from a fixed seed over every option of scan, in every spelling
Click knows (--opt value, --opt=value, -ovalue, clusters, repeats, --), with values Click refuses among them."""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path
from typing import Any, Optional

import pytest
import typer.main

from dtypeaudit import cli_commands, cli_options
from dtypeaudit.cli import app
from dtypeaudit.cli_parse import Declined, light_command, parse
from dtypeaudit.render import OutputFormat


def _click_runner(name: str) -> Any:
    """What Typer's parse gives the command's body for a line (None: it did not call it: an error, help)."""
    group = typer.main.get_command(app)
    body_name = cli_options.LIGHT[name].body
    recorded: list[dict[str, Any]] = []

    def body(**values: Any) -> None:
        recorded.append(values)

    def run(argv: list[str]) -> Optional[dict[str, Any]]:
        recorded.clear()
        saved = getattr(cli_commands, body_name)
        setattr(cli_commands, body_name, body)  # the callback looks the body up by name at each call
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                group.main([name, *argv], prog_name="dtypeaudit", standalone_mode=False)
        except Exception as exc:  # Click's usage errors (NoSuchOption, BadParameter, MissingParameter ...)
            assert type(exc).__module__.startswith(("typer._click", "click")), repr(exc)
        finally:
            setattr(cli_commands, body_name, saved)
        return recorded[0] if recorded else None

    return run


@pytest.fixture(scope="module")
def click_scan() -> Any:
    return _click_runner("scan")


@pytest.fixture(scope="module")
def click_convert() -> Any:
    return _click_runner("convert")


def light(argv: list[str], command: cli_options.Command = cli_options.SCAN) -> Optional[dict[str, Any]]:
    try:
        return parse(command, argv)
    except Declined:
        return None


def _words(command: cli_options.Command = cli_options.SCAN) -> list[str]:
    words = []
    for opt in command.params:
        words.extend(opt.flags)
    words += ["--", "-", "-h", "--help", "--nope"]  # the end of options, stdin, help, an unknown option
    if command is cli_options.CONVERT:
        return words + [
            "--to=fp16",
            "--to=half",
            "-tbf16",
            "-t",
            "-nfjson",
            "-n",
            "-kfc",
            "--keep=fc",
            "-j2",
            "--max-shard-size=5GB",
            "--format=json",
            "-oout.pt",
        ]
    return words + [
        "-z",
        "--format=json",
        "--format=bogus",
        "--values=1",
        "--jobs=3",
        "--jobs=x",
        "--exclude=*.bin",
        "--policy=",
        "-fjson",
        "-f=json",
        "-fplain",
        "-vq",
        "-qv",
        "-vfjson",
        "-vj2",
        "-j4",
        "-jx",
        "-pp.yaml",
        "-oout.txt",
        "-mmod:f",
        "-vm",
        "-qh",
    ]


VALUES = ["a.pt", "b dir/", "json", "plain", "table", "sarif", "JSON", "bogus", "3", "-1", " 4", "2.5", "x", ""]
VALUES += ["--", "-", "-v", "=", "é.pt"]


CONVERT_VALUES = ["fp16", "bf16", "fp32", "FP16", "float16", "half", "int8", "a.pt", "out dir/", "json", "text", "2", "x", "5GB", ""]


def _lines(seed: int, count: int, command: cli_options.Command = cli_options.SCAN) -> list[list[str]]:
    rng = random.Random(seed)
    words = _words(command)
    values = CONVERT_VALUES if command is cli_options.CONVERT else VALUES
    lines = []
    for _ in range(count):
        line = [rng.choice(words) if rng.random() < 0.55 else rng.choice(values) for _ in range(rng.randint(0, 7))]
        if rng.random() < 0.7:
            line.insert(rng.randint(0, len(line)), "model.pt")
        lines.append(line)
    return lines


ACCEPTED = [
    ["model.pt"],
    ["--format", "plain", "--quiet", "a.pt", "b.safetensors"],  # the pre-commit hook's entry (.pre-commit-hooks.yaml)
    ["a.pt", "b.pt", "-f", "json"],
    ["--format=plain", "a.pt", "-o", "out.txt"],
    ["-fjson", "-vq", "a.pt"],
    ["a.pt", "--exclude", "*.bin", "--exclude=*.pt", "-j", "2", "--jobs=3"],
    ["--values", "--include-optimizer", "--strict", "--debug", "a.pt", "--", "-f", "--help"],
    ["-pp.yaml", "--preset", "fp16", "--target", "t4", "--fail-on", "warning", "--explain", "fc.weight", "a.pt"],
    ["-m", "net.py:build", "--cluster", "local", "-", "a.pt", "-j", "-1"],
    ["a.pt", "-f", "json", "--format", "sarif"],
]
DECLINED = [[], ["--help"], ["a.pt", "-h"], ["a.pt", "-vh"], ["a.pt", "--format"], ["a.pt", "-f", "bogus"], ["a.pt", "--frmat=json"]]


@pytest.mark.parametrize("argv", ACCEPTED, ids=lambda a: " ".join(a))
def test_lines_it_runs(click_scan, argv: list[str]) -> None:
    expected = click_scan(argv)
    assert expected is not None and light(argv) == expected


@pytest.mark.parametrize("argv", DECLINED, ids=lambda a: " ".join(a) or "nothing")
def test_lines_it_leaves_to_typer(click_scan, argv: list[str]) -> None:
    assert light(argv) is None


def test_values_are_typed_as_typer_types_them(click_scan) -> None:
    values = light(["a.pt", "-f", "json", "-o", "r.json", "-j", "2", "--exclude", "x"])
    assert values is not None
    assert values["fmt"] is OutputFormat.json and values["output"] == Path("r.json") and values["jobs"] == 2
    assert values["targets"] == ["a.pt"] and values["exclude"] == ["x"] and values["policy"] is None and values["values"] is False


GENERATED = [("scan", seed) for seed in range(8)] + [("convert", seed) for seed in range(4)]


@pytest.mark.parametrize(("name", "seed"), GENERATED, ids=[f"{n}-{s}" for n, s in GENERATED])
def test_generated_lines_agree_with_click(request: pytest.FixtureRequest, name: str, seed: int) -> None:
    command, click = cli_options.LIGHT[name], request.getfixturevalue(f"click_{name}")
    ran = declined_valid = 0
    for argv in _lines(seed, 250, command):
        expected, got = click(argv), light(argv, command)
        if got is not None:
            assert got == expected, argv
            ran += 1
        elif expected is not None:
            declined_valid += 1
    # the interpreter declines only what it does not understand: most lines Click accepts, it runs
    assert ran > 0 and declined_valid * 10 <= ran, (ran, declined_valid)


CONVERT_ACCEPTED = [
    ["model.pt", "--to", "fp16"],
    ["-t", "bf16", "dir/", "-o", "out/", "--max-shard-size", "5GB", "-f", "json"],
    ["a.pt", "--to=fp32", "-k", "fc", "--keep", "norm", "--clamp", "--keep-unsafe", "-n", "--check-values"],
    ["a.pt", "b.pt", "--to", "fp16", "-j", "2", "--force", "--strip-optimizer", "--", "-c.pt"],
]


@pytest.mark.parametrize("argv", CONVERT_ACCEPTED, ids=lambda a: " ".join(a))
def test_convert_lines_it_runs(click_convert, argv: list[str]) -> None:
    expected = click_convert(argv)
    assert expected is not None and light(argv, cli_options.CONVERT) == expected


def test_help_and_completion_go_to_typer() -> None:
    assert light_command(["scan", "a.pt"], {}) is not None
    assert light_command(["scan", "a.pt", "--help"], {}) is None
    assert light_command(["scan", "a.pt"], {"_DTYPEAUDIT_COMPLETE": "bash_complete"}) is None
    assert light_command(["convert", "a.pt", "--to", "fp16"], {}) is not None
    assert light_command(["convert", "a.pt", "--help"], {}) is None
    assert light_command(["convert", "a.pt"], {}) is None  # --to is required: Typer's usage error
    assert light_command(["--version", "scan", "a.pt"], {}) is None


@pytest.mark.parametrize("columns", [None, "", "0", "-5", "abc", "50", "90", "120 ", "300"])
def test_terminal_width_is_shutils(monkeypatch: pytest.MonkeyPatch, columns: Optional[str]) -> None:
    """cli_commands.terminal_width asks what shutil.get_terminal_size asks, without importing shutil on a scan."""
    import shutil

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert cli_commands.terminal_width() == max(80, min(shutil.get_terminal_size((120, 24)).columns, 200))


@pytest.mark.parametrize(
    "args",
    [["{pt}"], ["{pt}", "-f", "json"], ["{pt}", "{st}", "-qfplain"], ["{pt}", "--policy", "{missing}"], ["{missing}"]],
    ids=["plain", "json", "quiet-two", "bad-policy", "unreadable"],
)
def test_both_fronts_run_scan_alike(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The light path (what entry.main runs, here without its os._exit after torch, which this process has loaded)
    and the Typer app: the same exit code, report and stderr."""
    import torch
    from safetensors.torch import save_file

    torch.save({"fc.weight": torch.ones(4, 2), "fc.bias": torch.zeros(4, dtype=torch.float16)}, tmp_path / "m.pt")
    save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "m.safetensors")
    paths = {"pt": tmp_path / "m.pt", "st": tmp_path / "m.safetensors", "missing": tmp_path / "nothing.yaml"}
    argv = ["scan", *(a.format(**{k: str(v) for k, v in paths.items()}) for a in args)]
    _both_fronts_alike(argv, monkeypatch, capsys)


def _both_fronts_alike(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *, written: Optional[Path] = None
) -> None:
    """Run ``argv`` through Typer, then the light path: the same exit code, report, stderr (and ``written``'s bytes)."""
    from typer.testing import CliRunner

    env = {"NO_COLOR": "1", "COLUMNS": "100"}
    typer_run = CliRunner().invoke(app, argv, env=env, prog_name="dtypeaudit")
    typer_bytes = written.read_bytes() if written is not None and written.exists() else None
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run = light_command(argv, {})
    assert run is not None  # the light path runs it
    with pytest.raises(SystemExit) as done:
        run()
    out, err = capsys.readouterr()
    assert (done.value.code, out, err) == (typer_run.exit_code, typer_run.stdout, typer_run.stderr)
    assert out or err
    if written is not None:
        assert (written.read_bytes() if written.exists() else None) == typer_bytes


@pytest.mark.parametrize(
    "args",
    [
        ["{pt}", "--to", "fp16", "--dry-run"],
        ["{pt}", "-t", "bf16", "-n", "--check-values", "-f", "json"],
        ["{pt}", "--to", "fp16", "-o", "{out}", "--force"],
        ["{missing}", "--to", "fp16"],
    ],
    ids=["dry-run", "check-values-json", "write", "unreadable"],
)
def test_both_fronts_run_convert_alike(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A convert line runs without Typer too: the same exit code, report, stderr and output file."""
    import torch

    torch.save({"fc.weight": torch.randn(4, 2), "fc.bias": torch.zeros(4)}, tmp_path / "m.pt")
    paths = {"pt": tmp_path / "m.pt", "out": tmp_path / "out.pt", "missing": tmp_path / "nothing.pt"}
    argv = ["convert", *(a.format(**{k: str(v) for k, v in paths.items()}) for a in args)]
    _both_fronts_alike(argv, monkeypatch, capsys, written=paths["out"])
