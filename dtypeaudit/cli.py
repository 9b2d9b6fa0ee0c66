"""The command line: parse, call the library, render, map the outcome to an exit code. Nothing else."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from . import __version__, exitcodes
from .errors import DtypeAuditError, UsageError
from .inventory import Report, Severity
from .render import OutputFormat, renderer_for

app = typer.Typer(
    name="dtypeaudit",
    help=(
        "Audit the dtypes of PyTorch checkpoints without running their code, and convert them safely.\n\n"
        "Exit codes: 0 clean, 1 findings at or above --fail-on, 2 unreadable input or misuse, 130 interrupted."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtypeaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Audit and convert PyTorch checkpoint dtypes."""


def _fail(message: str, code: int = exitcodes.ERROR) -> NoReturn:
    typer.echo(f"dtypeaudit: error: {message}", err=True)
    raise typer.Exit(code)


def default_format(stream: object = None) -> OutputFormat:
    """Rich on a terminal; plain text when piped, when NO_COLOR is set or TERM is dumb."""
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", lambda: False)()
    if not isatty or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return OutputFormat.plain
    return OutputFormat.table


def _terminal_width() -> int:
    try:
        return max(80, min(os.get_terminal_size().columns, 200))
    except OSError:
        return 120


def emit(text: str, output: Optional[Path]) -> None:
    """Write the report to ``-o FILE`` or stdout; stdout carries nothing else."""
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write the report ({exc.strerror or exc})", path=str(output)) from None
    typer.echo(f"dtypeaudit: report written to {output}", err=True)


def _log_unreadable(report: Report) -> None:
    """One line on stderr per input that could not be read, whatever format stdout carries."""
    for c in report.checkpoints:
        if c.error:
            typer.echo(f"dtypeaudit: error: {c.error}", err=True)


def run_guarded(fn, debug: bool) -> None:  # type: ignore[no-untyped-def]
    """Run a command body: one-line errors with exit 2, 130 on Ctrl-C, tracebacks only under --debug."""
    try:
        fn()
    except typer.Exit:
        raise
    except DtypeAuditError as exc:
        if debug:
            raise
        _fail(exc.one_line())
    except KeyboardInterrupt:
        typer.echo("dtypeaudit: interrupted", err=True)
        raise typer.Exit(exitcodes.INTERRUPTED) from None
    except Exception as exc:  # a bug of ours: say so in one line, keep the traceback for --debug
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback, and please report it)")


FormatOpt = Annotated[
    Optional[OutputFormat],
    typer.Option("--format", "-f", help="Output format. Default: a table on a terminal, plain text when piped."),
]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to FILE instead of stdout.")]
FailOnOpt = Annotated[
    str, typer.Option("--fail-on", help="Lowest finding severity that makes the run exit 1: error, warning or info.")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="List every tensor and every detail.")]


def _severity(value: str) -> Severity:
    if value not in ("error", "warning", "info"):
        raise UsageError(f"--fail-on must be error, warning or info, not '{value}'")
    return value  # type: ignore[return-value]


@app.command()
def scan(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="Checkpoint files, model directories, globs, or a factory (path/to/file.py:func, package.module:func).",
            show_default=False,
        ),
    ],
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help="A factory (file.py:func or module:func) whose parameters and buffers give each tensor its kind and module type."),
    ] = None,
    fail_on: FailOnOpt = "error",
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="Checkpoints read in parallel (default: one per core).")] = None,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List every tensor's dtype, shape and kind, reading only metadata, and report anything suspicious.

    \b
    Examples:
      dtypeaudit scan model.pt
      dtypeaudit scan ./Llama-3-8B/ --format json
      dtypeaudit scan checkpoints/ --fail-on warning
      dtypeaudit scan mymodels/net.py:build_model
    """

    def body() -> None:
        from .scan import scan as run_scan

        severity = _severity(fail_on)
        report: Report = run_scan(targets, model=model, fail_on=severity, jobs=jobs, raise_errors=debug)
        chosen = fmt or (OutputFormat.plain if output else default_format())
        emit(renderer_for(chosen, width=_terminal_width(), verbose=verbose)(report), output)
        _log_unreadable(report)
        raise typer.Exit(exitcodes.for_report(report))

    run_guarded(body, debug)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
