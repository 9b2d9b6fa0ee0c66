"""What each command does with its option values: one function per command, called by the Typer app (cli.py)
and by the light interpreter (cli_parse.py, ``scan`` without Typer) alike. Nothing here imports Typer or Click:
a body ends with ``SystemExit(code)``; errors become one line on stderr and an exit code in ``run_guarded``.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

from . import exitcodes
from ._version import __version__
from .errors import DtypeAuditError, UsageError
from .inventory import Report
from .render import OutputFormat, renderer_for

if TYPE_CHECKING:
    from .formats.locate import TargetRef


def say(message: str) -> None:
    """One line on stderr (what ``typer.echo(..., err=True)`` wrote), flushed at once."""
    print(message, file=sys.stderr, flush=True)


def fail(message: str, code: int = exitcodes.ERROR) -> NoReturn:
    say(f"dtypeaudit: error: {message}")
    raise SystemExit(code)


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
    """The terminal's width (or $COLUMNS), kept between 80 and 200 columns; 120 when unknown.

    The columns of ``shutil.get_terminal_size((120, 24))``, asked as it asks (a positive integer $COLUMNS, else
    stdout's terminal, else the fallback) without importing shutil, whose archive modules a scan never uses."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 120  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 120
    return max(80, min(columns, 200))


def emit(text: str, output: Optional[Path]) -> None:
    """Write the report to ``-o FILE`` or stdout; stdout carries nothing else."""
    if output is None:
        from .render.humanize import for_encoding

        # A console that cannot show the report's symbols (cp1252, ascii) gets them in ASCII, not a crash.
        sys.stdout.write(for_encoding(text, getattr(sys.stdout, "encoding", None)))
        sys.stdout.flush()
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write the report ({exc.strerror or exc})", path=str(output)) from None
    say(f"dtypeaudit: report written to {output}")


PEOPLE_FORMATS = (OutputFormat.table, OutputFormat.plain, OutputFormat.markdown, OutputFormat.github)


def _log_unreadable(report: Report, fmt: OutputFormat, output: Optional[Path]) -> None:
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


def run_guarded(fn: Callable[[], None], debug: bool) -> None:
    """Run a command body: one-line errors with exit 2, 130 on Ctrl-C, tracebacks only under --debug.

    A body ends with ``SystemExit`` (a BaseException: it passes through), whichever front called it."""
    try:
        fn()
    except DtypeAuditError as exc:
        if debug:
            _debug_traceback(exc)
        fail(exc.one_line())
    except KeyboardInterrupt:
        say("dtypeaudit: interrupted")
        raise SystemExit(exitcodes.INTERRUPTED) from None
    except OSError as exc:  # the machine said no (a full disk, say): one line, and not a bug report
        if debug:
            _debug_traceback(exc)
        fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    except Exception as exc:  # a bug of ours: exit 3 (not an input verdict), with what a bug report needs
        if debug:
            _debug_traceback(exc)
        say(
            f"dtypeaudit: internal error: {type(exc).__name__}: {exc}\n"
            f"dtypeaudit {__version__}, Python {sys.version.split()[0]}: this is a bug in dtypeaudit, not in your input; "
            "please report it with the output of the same command run with --debug"
        )
        raise SystemExit(exitcodes.INTERNAL) from None


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


def scan(
    targets: list[str],
    policy: Optional[str],
    preset: Optional[str],
    fmt: Optional[OutputFormat],
    output: Optional[Path],
    model: Optional[str],
    fail_on: Optional[str],
    explain: Optional[str],
    values: bool,
    include_optimizer: bool,
    jobs: Optional[int],
    cluster: Optional[str],
    strict: bool,
    target: Optional[str],
    exclude: Optional[list[str]],
    verbose: bool,
    quiet: bool,
    debug: bool,
) -> None:
    """``dtypeaudit scan`` (its options: cli_options.SCAN)."""

    def body() -> None:
        from .formats.locate import parse_target
        from .options import effective
        from .pipeline import scan as run_scan

        named = [parse_target(t) for t in targets]
        require_torch_for_factories(named, model, "scan")
        chosen_options = effective(policy, preset=preset, target=target, fail_on=fail_on)
        pol = chosen_options.policy
        fails_at = chosen_options.fail_on
        if explain is not None:
            _explain(named, pol, explain, model)
        progress = _progress_callback()
        checks = chosen_options.checks()
        if include_optimizer and not values:
            raise UsageError("--include-optimizer applies to --values")
        if values:
            from functools import partial

            from .conversion import value_findings

            checks.append(partial(value_findings, include_optimizer=include_optimizer))
        report: Report = run_scan(
            named,
            checks=checks,
            model=model,
            fail_on=fails_at,
            policy_name=pol.source if pol else None,
            policy=pol,
            jobs=jobs,
            cluster=cluster,
            raise_errors=debug,
            exclude=tuple(exclude or ()),
            progress=progress,
            strict=strict or (pol.strict if pol else False),
        )
        if quiet and verbose:
            raise UsageError("give --quiet or --verbose, not both")
        chosen = chosen_format(fmt, output)
        # The report lives until exit: the collector need not walk it again each time the renderer allocates
        # (a tenth of a 10,000-checkpoint scan's time went to that).
        gc.freeze()
        emit(renderer_for(chosen, width=terminal_width(), verbose=verbose, quiet=quiet)(report), output)
        _log_unreadable(report, chosen, output)
        raise SystemExit(exitcodes.for_report(report))

    run_guarded(body, debug)


def _progress_callback():
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


def _explain(targets: list[TargetRef], pol, name: str, model: Optional[str]) -> None:
    from .checks import as_policies_see_it
    from .formats.hfload import loaded_names
    from .pipeline import expand_targets, model_inventory, prepare, read_target
    from .policy import decide
    from .redact import redact
    from .render import explain as explain_render

    if pol is None:
        raise UsageError("--explain needs --policy or --preset")
    model_inv = model_inventory(model)
    code = exitcodes.CLEAN
    found = False
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
        found = True
        sys.stdout.write(f"{redact(path)}\n" + explain_render.render(pol, t))
        if not decide(pol, t).ok:
            code = exitcodes.FINDINGS
    if not found:
        raise UsageError(f"no tensor named '{name}' in {', '.join(t.text for t in targets)}")
    raise SystemExit(code)


def policy_init(
    checkpoint: str,
    output: Optional[Path],
    debug: bool,
) -> None:
    """``dtypeaudit policy init`` (its options: cli_options.POLICY_INIT)."""

    def body() -> None:
        from .baseline import render_baseline
        from .formats.locate import parse_target
        from .pipeline import read_target

        named = parse_target(checkpoint)
        require_torch_for_factories([named], None, "policy init")
        emit(render_baseline(read_target(named)), output)

    run_guarded(body, debug)


def policy_validate(
    files: list[str],
    debug: bool,
) -> None:
    """``dtypeaudit policy validate`` (its options: cli_options.POLICY_VALIDATE)."""

    def body() -> None:
        from .policy import load_policy

        for f in files:
            pol = load_policy(f)
            extends = f", extends {' -> '.join(pol.extends)}" if pol.extends else ""
            print(f"{f}: valid ({len(pol.rules)} rules{extends}{', strict' if pol.strict else ''})")

    run_guarded(body, debug)


def policy_presets() -> None:
    """``dtypeaudit policy presets`` (its options: cli_options.POLICY_PRESETS)."""

    from .policy import presets

    shipped = presets()
    width = max(len(p.name) for p in shipped)
    for p in shipped:
        print(f"{p.name:{width}}  {p.description}")


def targets(
    name: Optional[str],
    fmt: str,
    debug: bool,
) -> None:
    """``dtypeaudit targets`` (its options: cli_options.TARGETS)."""

    def body() -> None:
        import json

        from . import targets as table

        if fmt not in ("text", "markdown", "json"):
            raise UsageError(f"--format must be text, markdown or json, not '{fmt}'")
        chosen = [table.resolve(name)] if name is not None else list(table.TARGETS)
        if fmt == "json":
            emit(json.dumps(table.as_json(chosen), indent=2) + "\n", None)
        elif fmt == "markdown":
            emit(table.render_markdown(chosen), None)
        else:
            emit(table.render_detail(chosen[0]) if name is not None else table.render_text(chosen), None)

    run_guarded(body, debug)


def diff(
    a: str,
    b: str,
    tolerance: Optional[float],
    no_values: bool,
    fmt: str,
    output: Optional[Path],
    verbose: bool,
    debug: bool,
) -> None:
    """``dtypeaudit diff`` (its options: cli_options.DIFF)."""

    def body() -> None:
        import math

        from .diff import diff as run_diff
        from .formats.locate import parse_target
        from .pipeline import read_target
        from .render.diff import render_json, render_text

        before, after = parse_target(a), parse_target(b)
        require_torch_for_factories([before, after], None, "diff")
        if fmt not in ("text", "json", "html"):
            raise UsageError(f"--format must be text, json or html, not '{fmt}'")
        if tolerance is not None and not (tolerance >= 0 and math.isfinite(tolerance)):
            raise UsageError(f"--tolerance must be a finite number >= 0, not {tolerance}")
        if tolerance is not None and no_values:
            raise UsageError("--tolerance compares values; --no-values reads none")
        result = run_diff(read_target(before), read_target(after), tolerance=tolerance, values=not no_values)
        if fmt == "html":
            from .render.html import render_diff

            emit(render_diff(result), output)
        else:
            emit(render_json(result) if fmt == "json" else render_text(result, verbose=verbose), output)
        raise SystemExit(exitcodes.FINDINGS if result.differs else exitcodes.CLEAN)

    run_guarded(body, debug)


def convert(
    sources: list[str],
    to: str,
    output: Optional[str],
    policy: Optional[str],
    preset: Optional[str],
    keep: Optional[list[str]],
    include_optimizer: bool,
    strip_optimizer: bool,
    clamp: bool,
    keep_unsafe: bool,
    max_shard_size: Optional[str],
    model: Optional[str],
    materialize_ties: bool,
    keep_quantized: bool,
    dry_run: bool,
    check_values: bool,
    target: Optional[str],
    force: bool,
    jobs: Optional[int],
    cluster: Optional[str],
    in_place: bool,
    fmt: str,
    verbose: bool,
    debug: bool,
) -> None:
    """``dtypeaudit convert`` (its options: cli_options.CONVERT)."""

    def body() -> None:
        from .conversion import convert as run_convert
        from .extras import require
        from .render.convert import refusal_lines, render_json, render_text

        if fmt not in ("text", "json"):
            raise UsageError(f"--format must be text or json, not '{fmt}'")
        if in_place and output is not None:
            raise UsageError("give --in-place or --output, not both")
        if target is not None and not dry_run:
            raise UsageError("--target checks a plan: give --dry-run too")
        if check_values and not dry_run:
            raise UsageError("--check-values reads the values for a plan: give --dry-run too (a conversion always checks them)")
        if model:
            require("torch", "dtypeaudit convert --model")
        from .options import effective

        # One resolver for the policy, the target and the failing severity. --target replaces the policy's own
        # `target:`, as for scan: its findings are the plan's hardware section (below), so the plan is checked
        # against the policy without its target; otherwise the policy's target holds the plan, as it holds a scan.
        chosen = effective(policy, preset=preset, target=target)
        options: dict[str, Any] = {
            "policy": chosen.policy_alone if target is not None else chosen.policy,
            "keep": tuple(keep or ()),
            "include_optimizer": include_optimizer,
            "strip_optimizer": strip_optimizer,
            "clamp": clamp,
            "keep_unsafe": keep_unsafe,
            "dry_run": dry_run,
            "read_values": check_values,
            "force": force,
            "in_place": in_place,
            "max_shard_size": max_shard_size,
            "model": model,
            "materialize_ties": materialize_ties,
            "keep_quantized": keep_quantized,
        }
        if len(sources) > 1 or jobs is not None or cluster is not None:
            if target is not None:
                raise UsageError("--target checks one plan: give one SOURCE")
            raise SystemExit(
                _convert_many(sources, to, output, options, jobs=jobs, cluster=cluster, as_json=fmt == "json", verbose=verbose, debug=debug)
            )
        (source,) = sources
        hardware = chosen.target if target is not None else None  # --target only: it checks the plan
        progress = _ByteProgress() if sys.stderr.isatty() else None
        try:
            result = run_convert(source, to, output=output, progress_factory=progress, **options)
        finally:
            if progress is not None:
                progress.close()
        text = render_json(result) if fmt == "json" else render_text(result, verbose=verbose)
        unfit = False
        if hardware is not None and not result.refused:
            from .targets import plan_report

            text, unfit = plan_report(text, result.plan.output_inventory(), hardware, as_json=fmt == "json", fail_on=chosen.fail_on)
        emit(text, None)
        for line in refusal_lines(result):
            say(f"dtypeaudit: {line}")
        raise SystemExit(exitcodes.FINDINGS if result.blocked or unfit else exitcodes.CLEAN)

    run_guarded(body, debug)


def trace(
    model: str,
    checkpoint: Optional[str],
    inputs: Optional[list[str]],
    input_factory: Optional[str],
    autocast: Optional[str],
    backward: bool,
    loss: str,
    default_dtype: Optional[str],
    allow_promotion: Optional[list[str]],
    policy: Optional[str],
    preset: Optional[str],
    hardware: Optional[str],
    fmt: Optional[OutputFormat],
    output: Optional[Path],
    fail_on: Optional[str],
    verbose: bool,
    debug: bool,
) -> None:
    """``dtypeaudit trace`` (its options: cli_options.TRACE)."""

    def body() -> None:
        from .extras import require

        require("torch", "dtypeaudit trace")
        from .options import effective
        from .render.trace import renderer_for as trace_renderer_for
        from .trace import trace as run_trace

        chosen_options = effective(policy, preset=preset, target=hardware, fail_on=fail_on)
        report = run_trace(
            model,
            inputs=tuple(inputs or ()),
            input_factory=input_factory,
            checkpoint=checkpoint,
            autocast=autocast,
            backward=backward,
            loss=loss,
            default_dtype=default_dtype,
            allow_promotion=tuple(allow_promotion or ()),
            fail_on=chosen_options.trace_fail_on,
            policy=chosen_options.policy,
            target=chosen_options.target,
        )
        chosen = chosen_format(fmt, output)
        emit(trace_renderer_for(chosen, width=terminal_width(), verbose=verbose)(report), output)
        raise SystemExit(exitcodes.for_report(report))

    run_guarded(body, debug)


def _convert_many(
    sources: list[str],
    to: str,
    output: Optional[str],
    options: dict,
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

    from . import dtypes, fleet
    from .conversion import ConvertWork, convert_lost, convert_one
    from .formats.locate import parse_target
    from .render.convert import refusal_lines, render_json, render_text

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
        target = dtypes.conversion_target(to)
        for ref in refs:
            dest = os.path.abspath(out_dir / _output_name(ref, target))
            if dest in outputs.values():
                raise UsageError(f"two sources would be written to {dest}; convert them into different directories")
            outputs[ref.identity] = dest
    work = ConvertWork(to, options, outputs, raise_errors=debug)
    done = fleet.run(
        convert_one,
        refs,
        work,
        jobs=jobs or (None if cluster else 1),
        cluster=cluster,
        lost=convert_lost,
    )
    texts = []
    docs = []
    code = exitcodes.CLEAN
    for c in done:
        if c.error is not None:
            docs.append({"schema": "dtypeaudit.convert/1", "source": c.source, "error": c.error})
            code = exitcodes.ERROR
            continue
        docs.append(json.loads(render_json(c.result)))
        texts.append(render_text(c.result, verbose=verbose))
        if c.result.blocked and code == exitcodes.CLEAN:
            code = exitcodes.FINDINGS
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
    return code


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


class _ByteProgress:
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
            done += n
            self.bar.update(task, completed=done)
            if done >= total:
                self.bar.remove_task(task)

        return advance

    def close(self) -> None:
        if self.bar.live.is_started:
            self.bar.stop()


def root(version: bool) -> None:
    """Audit and convert PyTorch checkpoint dtypes (``--version`` is answered by its callback, in cli.py)."""
