"""What the commands of the Typer app (cli.py) share: where a report goes and in which format, one-line errors and
their exit codes (``run_guarded``), progress on a terminal, ``scan --explain`` and ``convert SOURCE...``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from . import exitcodes
from ._version import __version__
from .errors import DtypeAuditError, UsageError
from .inventory import Report
from .render import OutputFormat

if TYPE_CHECKING:
    from .formats.locate import TargetRef
    from .options import ConvertSettings
    from .policy import Policy


def say(message: str) -> None:
    """One line on stderr (what ``typer.echo(..., err=True)`` wrote), flushed at once."""
    print(message, file=sys.stderr, flush=True)


def _colorless() -> bool:
    """NO_COLOR (https://no-color.org) or a dumb terminal: no ANSI, whatever format was asked for."""
    return bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"


def default_format(stream: object = None) -> OutputFormat:
    """Rich on a terminal; plain text when piped, when NO_COLOR is set or TERM is dumb."""
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", lambda: False)()
    if not isatty or _colorless():
        return OutputFormat.plain
    return OutputFormat.table


def chosen_format(fmt: Optional[OutputFormat], output: Optional[Path]) -> OutputFormat:
    """``--format``, else the default for where the report goes; ``table`` is ``plain`` under NO_COLOR."""
    chosen = fmt or (OutputFormat.plain if output else default_format())
    return OutputFormat.plain if chosen is OutputFormat.table and _colorless() else chosen


def terminal_width() -> int:
    """The terminal's width (or $COLUMNS), kept between 80 and 200 columns; 120 when unknown."""
    import shutil

    return max(80, min(shutil.get_terminal_size((120, 24)).columns, 200))


def emit(text: str | Iterable[str], output: Optional[Path], what: str = "report") -> None:
    """Write the report (or ``what`` else it is: a policy) to ``-o FILE`` or stdout; stdout carries nothing else.
    ``text`` may come in pieces, each written as it is made (a million-tensor JSON report is never one string)."""
    pieces = (text,) if isinstance(text, str) else text
    if output is None:
        from .render.humanize import for_encoding

        # A console that cannot show the report's symbols (cp1252, ascii) gets them in ASCII, not a crash.
        encoding = getattr(sys.stdout, "encoding", None)
        for piece in pieces:
            sys.stdout.write(for_encoding(piece, encoding))
        sys.stdout.flush()
        return
    try:
        with output.open("w", encoding="utf-8") as fh:
            fh.writelines(pieces)
    except OSError as exc:
        raise UsageError(f"cannot write the {what} ({exc.strerror or exc})", path=str(output)) from None
    say(f"dtypeaudit: {what} written to {output}")


PEOPLE_FORMATS = (OutputFormat.table, OutputFormat.plain, OutputFormat.markdown, OutputFormat.github)


def log_unreadable(report: Report, fmt: OutputFormat, output: Optional[Path]) -> None:
    """One line on stderr per input that could not be read, unless the report already told the person reading.

    The report names every unreadable input, with the reason. A report for people (text, markdown, GitHub
    annotations) on a terminal says it there, once; when the report goes to a pipe, a file or a machine format,
    the terminal (and a CI log that greps stderr) gets the one-line log instead.
    """
    if output is None and fmt in PEOPLE_FORMATS and getattr(sys.stdout, "isatty", lambda: False)():
        return
    for c in report.checkpoints:
        if c.error:
            say(f"dtypeaudit: error: {c.error}")


def run_guarded(command: Callable[[], int], debug: bool) -> int:
    """A command's exit code: its own, else 2 with one line for an error of the input, 130 on Ctrl-C, 3 for a bug
    of ours; tracebacks only under --debug."""
    try:
        return command()
    except DtypeAuditError as exc:
        if debug:
            _debug_traceback(exc)
        say(f"dtypeaudit: error: {exc.one_line()}")
    except KeyboardInterrupt:
        say("dtypeaudit: interrupted")
        return exitcodes.INTERRUPTED
    except OSError as exc:  # the machine said no (a full disk, say): one line, and not a bug report
        if debug:
            _debug_traceback(exc)
        say(f"dtypeaudit: error: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    except Exception as exc:  # a bug of ours: exit 3 (not an input verdict), with what a bug report needs
        if debug:
            _debug_traceback(exc)
        say(
            f"dtypeaudit: internal error: {type(exc).__name__}: {exc}\n"
            f"dtypeaudit {__version__}, Python {sys.version.split()[0]}: this is a bug in dtypeaudit, not in your input; "
            "please report it with the output of the same command run with --debug"
        )
        return exitcodes.INTERNAL
    return exitcodes.ERROR


def _debug_traceback(exc: BaseException) -> None:
    """--debug: the whole traceback, causes included (and the backend's error a remote error keeps out of tracebacks),
    on stderr before the usual line and exit code. A backend's own messages quote a URL with its credentials: shown
    without them, as every line we print."""
    import traceback

    from .redact import redact

    parts = traceback.format_exception(exc)
    hidden = exc.__context__ if exc.__suppress_context__ else None  # a remote backend's error, kept out of tracebacks
    if hidden is not None:
        parts = [*traceback.format_exception(hidden), "\nThat error became this one:\n\n", *parts]
    say(redact("".join(parts)).rstrip())


def leave_fast_after_torch(run: Callable[[], None]) -> None:
    """Run a whole command line. A process that loaded torch (convert, ``scan --values``) leaves with
    ``os._exit`` once its output is flushed: the interpreter's teardown of torch's modules takes a fifth of a
    second and does nothing a finished command needs. Every file the command wrote is closed by then."""
    try:
        run()
    except SystemExit as done:
        if "torch" not in sys.modules:
            raise
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def require_torch_for_factories(targets: list[TargetRef], model: Optional[str], command: str) -> None:
    """A factory (a target, or --model) builds a torch model: without torch, the one line that names the extra."""
    from .formats.locate import TargetKind

    if not model and not any(t.kind is TargetKind.FACTORY for t in targets):
        return  # no factory: the targets were parsed once, and a file's scan never imports the factory module
    from .extras import require

    if model:
        require("torch", f"dtypeaudit {command} --model")
    for t in targets:
        if t.kind is TargetKind.FACTORY:
            require("torch", f"dtypeaudit {command} {t.text}")


def scan_progress() -> Callable[[int, int, str], None] | None:
    """A progress line on stderr for long multi-checkpoint scans, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console

    console = Console(stderr=True)

    from .redact import redact  # a URL target may carry credentials: never shown

    def update(done: int, total: int, path: str) -> None:
        if total >= 4:
            console.print(f"[dim]scanned {done}/{total}: {redact(path)}[/dim]", end="\r" if done < total else "\n", highlight=False)

    return update


def explain(targets: list[TargetRef], pol: Policy | None, name: str, model: Optional[str]) -> int:
    """``scan --explain NAME``: which rule decides the tensor, in each target that holds it; exit 1 where it fails."""
    from .checks import as_policies_see_it
    from .formats.hfload import loaded_names
    from .pipeline import expand_targets, model_inventory, prepare, read_target
    from .policy import decide
    from .redact import redact
    from .render import explain as explain_render

    if pol is None:
        raise UsageError("--explain needs --policy or --preset")
    model_inv = model_inventory(model)
    passed: list[bool] = []
    for found_target in expand_targets(targets):
        path = found_target.text
        inv = prepare(read_target(found_target), model_inv)  # read -> structure, as scan's pipeline does
        if model_inv is not None:
            for f in inv.findings:
                if f.rule == "model-mismatch":
                    say(f"dtypeaudit: error: {path}: {f.message}")
        # The tensor as the policy sees it: a quantized weight as its logical weight, a folder's as from_pretrained loads it
        # a folder's tensor goes by its loaded name; its stored name finds it too
        t = {r.name: r for r in as_policies_see_it(inv)}.get(loaded_names(inv).get(name, name))
        if t is None:
            continue
        sys.stdout.write(f"{redact(path)}\n" + explain_render.render(pol, t))
        passed.append(decide(pol, t).ok)
    if not passed:
        raise UsageError(f"no tensor named '{name}' in {', '.join(t.text for t in targets)}")
    return exitcodes.for_explained(passed)


def convert_many(
    sources: list[str],
    output: Optional[str],
    settings: ConvertSettings,
    *,
    jobs: Optional[int],
    cluster: Optional[str],
    as_json: bool,
    verbose: bool,
    debug: bool,
) -> int:
    """``convert SOURCE...``: each source converted as in a single run, in ``jobs`` processes or on ``cluster``;
    the reports in the order given, one line on stderr per source that could not be converted. Exit code: the worst."""
    import json

    from . import fleet
    from .conversion import ConvertWork, convert_lost, convert_one
    from .formats.locate import parse_target
    from .render.convert import convert_doc, refusal_lines, render_json, render_text

    unique: dict[str, TargetRef] = {}
    for text in sources:
        # parsed once, a URL or a local path (convert takes no factory or bare hub id); fleet and convert take it as is
        ref = parse_target(text, models=False)
        unique.setdefault(ref.identity, ref)  # one source under two spellings (a path and its file:// URL) converts once
    refs = list(unique.values())
    several = len(refs) > 1
    outputs: dict[str, str] = {}  # by identity, absolute: a worker elsewhere has another working directory
    if output is not None and not several:
        outputs[refs[0].identity] = os.path.abspath(output)
    elif output is not None:
        out_dir = Path(output)
        if not out_dir.is_dir():
            raise UsageError("with several SOURCEs, -o names an existing directory to write each output into", path=str(output))
        for ref in refs:
            dest = os.path.abspath(out_dir / _output_name(ref, settings.to))
            if dest in outputs.values():
                raise UsageError(f"two sources would be written to {dest}; convert them into different directories")
            outputs[ref.identity] = dest
    work = ConvertWork(settings, outputs, raise_errors=debug)
    done = fleet.run(
        convert_one,
        refs,
        work,
        jobs=jobs or (None if cluster else 1),
        cluster=cluster,
        lost=convert_lost,
    )
    failed = {"schema": "dtypeaudit.convert/1"}
    docs = [convert_doc(c.result) if c.error is None else {**failed, "source": c.source, "error": c.error} for c in done]
    texts = [render_text(c.result, verbose=verbose) for c in done if c.error is None]
    if several:
        emit(json.dumps(docs, indent=2) + "\n" if as_json else "\n".join(texts), None)
    elif done[0].error is None:  # one source: the output of a plain `convert SOURCE`
        emit(render_json(done[0].result) if as_json else texts[0], None)
    for c in done:
        if c.error is not None:
            say(f"dtypeaudit: error: {c.error}")
        else:
            for line in refusal_lines(c.result):
                say(f"dtypeaudit: {line}")
    return exitcodes.worst(exitcodes.ERROR if c.error is not None else exitcodes.for_result(c.result) for c in done)


def _output_name(source: TargetRef, target: str) -> str:
    """The name of ``source``'s output in ``-o``'s directory: ``default_output``'s beside a local source; a remote
    source's from the last part of its URL's path, by the same rule (``s3://b/run/model.pt`` -> ``model.fp16.pt``)."""
    from pathlib import PurePosixPath
    from urllib.parse import urlsplit

    from .conversion.atomic import default_output
    from .redact import redact

    if source.is_local and isinstance(source.where, Path):
        return default_output(source.where, target).name
    last = PurePosixPath(urlsplit(source.text).path).name
    if not last:
        raise UsageError("names no file or folder to name its output after; convert it alone with -o", path=redact(source.text))
    return default_output(Path(last), target).name


@contextmanager
def tune_progress() -> Iterator[Callable[[str], None] | None]:
    """Each step of a tune (the fp32 run, the low-precision run, each try of the search) as a spinner's text on a
    terminal's stderr; nothing where stderr is not one."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console

    with Console(stderr=True).status("tuning") as status:
        yield lambda text: status.update(f"tuning: {text}")


class ByteProgress:
    """A Rich progress bar on stderr (bytes, rate, ETA), one task per phase; call it with a phase's total bytes."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )

    def __call__(self, label: str, total: int) -> Callable[[int], None]:
        if not self.bar.live.is_started:
            self.bar.start()
        task = self.bar.add_task(label, total=total)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            if done >= total:
                return  # finished: its task is gone
            done += n
            self.bar.update(task, completed=done)
            if done >= total:
                self.bar.remove_task(task)

        return advance

    def close(self) -> None:
        if self.bar.live.is_started:
            self.bar.stop()
