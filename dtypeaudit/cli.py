"""The command line: a Typer app, one annotated function per command, each calling the core and returning its exit
code (``exitcodes``). Help, completion and every usage error are Typer's; what the commands share (where a report
goes, one-line errors, progress bars, several conversions at once) is in ``cli_commands.py``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from . import exitcodes
from ._version import __version__
from .cli_commands import (
    ByteProgress,
    chosen_format,
    convert_many,
    emit,
    explain,
    leave_fast_after_torch,
    log_unreadable,
    require_torch_for_factories,
    run_guarded,
    say,
    scan_progress,
    terminal_width,
    tune_progress,
)
from .cli_commands import default_format as default_format  # where callers found it
from .errors import UsageError
from .render import OutputFormat, writer_for

app = typer.Typer(
    name="dtypeaudit",
    help=(
        "Audit the dtypes of PyTorch checkpoints without running their code, and convert them safely.\n\n"
        + "Exit codes: 0 clean, 1 findings at or above --fail-on, 2 unreadable input or misuse, "
        + "3 internal error (a bug: please report it), 130 interrupted."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # Click's own help: paragraphs rewrapped to the terminal, \b blocks kept as written, brackets such as
    # 'dtypeaudit[dask]' shown as typed (Rich markup took them for tags), no box drawing for a cp1252 console.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
policy_app = typer.Typer(help="Write, check and list dtype policies.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(policy_app, name="policy")


def _help_keeps_hyphenated_words() -> None:
    """Click wraps help text with textwrap's default break_on_hyphens: '--keep-unsafe' and 'security-sensitive'
    were split at their hyphens. Its wrapper class is looked up at each call (in the Click that Typer vendors as
    ``typer._click``, and in Click itself), so a subclass here changes how help wraps and nothing else."""
    from importlib import import_module

    for name in ("typer._click._textwrap", "click._textwrap"):
        try:
            wrapping = import_module(name)
        except ImportError:
            continue
        base = wrapping.TextWrapper
        if getattr(base, "keeps_hyphenated_words", False):
            continue

        class KeepHyphenatedWords(base):  # type: ignore[misc, valid-type]
            keeps_hyphenated_words = True

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("break_on_hyphens", False)
                super().__init__(*args, **kwargs)

        wrapping.TextWrapper = KeepHyphenatedWords  # type: ignore[attr-defined]


_help_keeps_hyphenated_words()


def exits(command: Callable[..., int]) -> Callable[..., None]:
    """A command that returns its exit code, run as Typer runs a command: an error of the input becomes one line and
    exit 2, a bug of ours exit 3, Ctrl-C 130, tracebacks only under --debug (``cli_commands.run_guarded``)."""

    @functools.wraps(command)  # Typer reads the command's own signature through __wrapped__
    def run(**values: Any) -> None:
        raise typer.Exit(run_guarded(lambda: command(**values), values.get("debug", False)))

    return run


# -- options more than one command takes ------------------------------------------------------------------------

Format = Annotated[
    Optional[OutputFormat], typer.Option("--format", "-f", help="Output format. Default: a table on a terminal, plain text when piped.")
]
ReportFile = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to FILE instead of stdout.")]
FailOn = Annotated[
    Optional[str],
    typer.Option(
        "--fail-on",
        help="Lowest finding severity that makes the run exit 1: error, warning or info. Default: the policy's, else error.",
    ),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="List every tensor and every detail.")]
Cluster = Annotated[
    Optional[str],
    typer.Option(
        "--cluster",
        help="Run the per-checkpoint work as tasks on a Dask distributed cluster: a scheduler address (tcp://host:8786) "
        "or 'local' (a LocalCluster of --jobs worker processes). Inputs must be readable by the workers under the names given "
        "(a shared filesystem, or URLs). Needs the dask extra: pip install 'dtypeaudit[dask]'.",
    ),
]
PolicyFile = Annotated[Optional[str], typer.Option("--policy", "-p", help="A YAML policy file (the language: docs/policies.md).")]
# The names from the shipped files themselves (a directory listing, not the policy module: a scan's start-up).
_PRESET_NAMES = sorted(p.stem for p in (Path(__file__).parent / "presets").glob("*.yaml"))
Preset = Annotated[
    Optional[str],
    typer.Option(
        "--preset",
        help=f"A shipped policy by name (`dtypeaudit policy presets` describes them): {', '.join(_PRESET_NAMES)}. "
        "fp16-mixed and bf16-mixed are aliases of the *-weights-fp32-norms presets (half-precision weights), not "
        "Lightning's 16-mixed/bf16-mixed, whose checkpoints keep fp32 weights: use amp-training.",
    ),
]


Exclude = Annotated[
    Optional[list[str]],
    typer.Option(
        "--exclude",
        help="Leave out files matching GLOB (their path inside the folder, or their name) when a folder is walked or "
        "safety-scanned; repeatable. Every file left out is listed in a left-out note; convert does not write it to "
        "its output either.",
        metavar="GLOB",
    ),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtypeaudit {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)] = False,
) -> None:
    """Audit and convert PyTorch checkpoint dtypes."""


@app.command()
@exits
def scan(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="Checkpoint files, model directories, globs, URLs (s3://, gs://, https://, hf://, any fsspec protocol), "
            "Hugging Face hub ids (org/name, org/name@revision: the local cache first), "
            "or a factory (path/to/file.py:func, package.module:func).",
            metavar="TARGET...",
            show_default=False,
        ),
    ],
    policy: PolicyFile = None,
    preset: Preset = None,
    fmt: Format = None,
    output: ReportFile = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            "-m",
            help="The model: a factory (file.py:func or module:func, returning a module or a transformers config), "
            "transformers:MODEL_TYPE, or a directory with config.json (as trace takes it); its parameters and buffers "
            "give each tensor its kind and module type. "
            "Without it, module types are guessed from names and shapes (BatchNorm, LayerNorm, RMSNorm, Linear, Conv2d, Embedding) "
            "and shown as guesses.",
        ),
    ] = None,
    fail_on: FailOn = None,
    explain_name: Annotated[Optional[str], typer.Option("--explain", help="Show which policy rule decides tensor NAME, and why.")] = None,
    values: Annotated[
        bool,
        typer.Option(
            "--values",
            help="Also read tensor values. NaN/Inf in any floating tensor is an error. float32/float64 tensors are held to "
            "fp16's range (overflow, underflow, subnormals), unless the checkpoint holds more bf16 than fp16, which keeps "
            "fp32's range; fp16 and bf16 tensors are checked for NaN/Inf only.",
        ),
    ] = False,
    include_optimizer: Annotated[
        bool,
        typer.Option(
            "--include-optimizer",
            help="With --values: hold optimizer state (Adam moments) to the same severities as weights. By default its "
            "value findings are info, since convert leaves optimizer state as it is.",
        ),
    ] = False,
    jobs: Annotated[
        Optional[int],
        typer.Option("--jobs", "-j", help="Checkpoints read in parallel, in local processes (default: one per core; 1: no workers)."),
    ] = None,
    cluster: Cluster = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Fail on anything a loader might read differently from dtypeaudit, for security-sensitive gates: "
            "loader-divergence, foreign-global, trailing-data and unused-weights findings become errors. "
            "Default: the policy's `strict`, else off.",
        ),
    ] = False,
    target: Annotated[
        Optional[str],
        typer.Option(
            "--target",
            help="A hardware target (`dtypeaudit targets` lists them: cpu, cpu-amx, t4, v100, a100, l4, h100, mi300, mps, sm_XY ...): "
            "floating dtypes it cannot compute are errors (unsupported-dtype), dtypes it only emulates warnings (emulated-dtype). "
            "Default: the policy's `target`.",
        ),
    ] = None,
    exclude: Exclude = None,
    verbose: Verbose = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="Findings only: no tensor or dtype tables, and no section for a checkpoint without findings (text and markdown; "
            "the pre-commit hook's default). Findings that share a rule and a cause are one row either way.",
        ),
    ] = False,
    all_rows: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Show every row of the text tables. By default the findings and tensor tables show their first 40 rows "
            "(the worst findings first) and say how many more there are; machine formats always carry everything.",
        ),
    ] = False,
    debug: Debug = False,
) -> int:
    """List every tensor's dtype, shape and kind, reading only metadata, and check it against a policy.

    \b
    Examples:
      dtypeaudit scan model.pt
      dtypeaudit scan ./Llama-3-8B/ --format json
      dtypeaudit scan model.pt --preset fp16-mixed
      dtypeaudit scan ckpts/ --policy policy.yaml --format sarif -o dtypeaudit.sarif
      dtypeaudit scan model.pt --policy policy.yaml --explain lm_head.weight
      dtypeaudit scan model.pt --values
      dtypeaudit scan model.pt --strict
      dtypeaudit scan model.safetensors --target v100
      dtypeaudit scan mymodels/net.py:build_model
      dtypeaudit scan s3://models/llama-3-8b/ --format json
      dtypeaudit scan meta-llama/Llama-3.1-8B
      dtypeaudit scan /shared/registry/ --cluster tcp://scheduler:8786 --format json -o audit.json
    """
    import gc

    from .formats.locate import parse_target
    from .options import effective
    from .pipeline import scan as run_scan

    if include_optimizer and not values:
        raise UsageError("--include-optimizer applies to --values")
    if quiet and verbose:
        raise UsageError("give --quiet or --verbose, not both")
    # resolved once, before any checkpoint is opened
    chosen = effective(policy, preset=preset, target=target, fail_on=fail_on, strict=strict)
    named = [parse_target(t) for t in targets]
    require_torch_for_factories(named, model, "scan")
    pol = chosen.policy
    if explain_name is not None:
        return explain(named, pol, explain_name, model)
    extra = []
    if values:
        from .conversion import value_findings

        extra.append(functools.partial(value_findings, include_optimizer=include_optimizer))
    # No cyclic collection from here to the exit: what a scan makes are records and tuples, freed by reference counts,
    # and the report lives until exit. The collector's passes walked all of it again each time the renderer allocated
    # (a tenth of a 10,000-checkpoint scan's time), and a million-tensor header's first pass after its read, once the
    # pipeline let the collector run again, took a second (benchmarks/SCALE.md).
    gc.freeze()
    gc.disable()
    try:
        report = run_scan(
            named,
            settings=chosen,
            checks=extra,
            model=model,
            jobs=jobs,
            cluster=cluster,
            raise_errors=debug,
            exclude=tuple(exclude or ()),
            progress=scan_progress(),
        )
    except BaseException:
        gc.enable()  # no report to keep: the collector is back for whatever the process does next
        raise
    shown = chosen_format(fmt, output)
    emit(writer_for(shown, width=terminal_width(), verbose=verbose, quiet=quiet, all_rows=all_rows)(report), output)
    log_unreadable(report, shown, output)
    return exitcodes.for_report(report)


@app.command()
@exits
def targets(
    name: Annotated[
        Optional[str],
        typer.Argument(
            help="One target (a name, an alias or sm_XY) to show in detail: why each dtype is or is not native, and the "
            "vendor documentation the row follows.",
            metavar="[NAME]",
            show_default=False,
        ),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text, markdown or json.")] = "text",
    debug: Debug = False,
) -> int:
    """List the hardware targets and which floating dtypes each computes natively, emulates, or cannot compute.

    \b
    Examples:
      dtypeaudit targets
      dtypeaudit targets v100
      dtypeaudit scan model.safetensors --target v100
    """
    import json

    from . import hardware as table

    if fmt not in ("text", "markdown", "json"):
        raise UsageError(f"--format must be text, markdown or json, not '{fmt}'")
    chosen = [table.resolve(name)] if name is not None else list(table.TARGETS)
    if fmt == "json":
        emit(json.dumps(table.as_json(chosen), indent=2) + "\n", None)
    elif fmt == "markdown":
        emit(table.render_markdown(chosen), None)
    else:
        emit(table.render_detail(chosen[0]) if name is not None else table.render_text(chosen), None)
    return exitcodes.CLEAN


@app.command()
@exits
def diff(
    a: Annotated[str, typer.Argument(help="The checkpoint before.", metavar="A", show_default=False)],
    b: Annotated[str, typer.Argument(help="The checkpoint after.", metavar="B", show_default=False)],
    tolerance: Annotated[
        Optional[float],
        typer.Option(
            "--tolerance",
            help="Compare values as numbers: tensors whose largest absolute difference is at most this are equal, across "
            "dtypes too (fp32 against its fp16 cast). Default: equal means the same bytes (CRC-32).",
            show_default=False,
        ),
    ] = None,
    no_values: Annotated[
        bool, typer.Option("--no-values", help="Compare names, dtypes, shapes and ties only; read no tensor bytes.")
    ] = False,
    fmt: Annotated[
        Optional[str],
        typer.Option(
            "--format",
            "-f",
            help="table or plain (the changes as text; text is an alias of plain), json, or html (both dtype maps side by "
            "side). Default: table on a terminal, plain when piped.",
        ),
    ] = None,
    output: ReportFile = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every tensor; by default repeated layers are folded.")] = False,
    debug: Debug = False,
) -> int:
    """Compare two checkpoints: tensors added or removed, dtype, shape and value changes, ties, size.

    Names match after a wrapper prefix (module., _orig_mod., state_dict., model_state_dict., model.) is
    taken off either side. Values compare by the CRC-32 of each tensor's elements, or as numbers with
    --tolerance. Tensors sharing a storage are shown once (a = b); a tie broken or created is listed.
    A checkpoint that scan fails for its safety (a code-running global, trailing data) is not compared: one
    line names it, exit 1.
    Exit codes: 0 identical, 1 they differ (or one is unsafe), 2 unreadable input or misuse.

    \b
    Examples:
      dtypeaudit diff model.pt model.fp16.pt
      dtypeaudit diff before.pt after.pt --tolerance 1e-3
      dtypeaudit diff ddp_checkpoint.pt plain.pt --format json
    """
    import math

    from .diff import diff as run_diff
    from .formats.locate import parse_target
    from .pipeline import read_target

    before, after = parse_target(a), parse_target(b)
    require_torch_for_factories([before, after], None, "diff")
    if fmt not in (None, "table", "plain", "text", "json", "html"):
        raise UsageError(f"diff writes table, plain, json or html, not '{fmt}'")
    if tolerance is not None and not (tolerance >= 0 and math.isfinite(tolerance)):
        raise UsageError(f"--tolerance must be a finite number >= 0, not {tolerance}")
    if tolerance is not None and no_values:
        raise UsageError("--tolerance compares values; --no-values reads none")
    from .safety import reader_refusals, refusal_line

    inventories = read_target(before), read_target(after)
    refused = {inv.path: (inv, found) for inv in inventories if (found := reader_refusals(inv))}.values()
    for inv, found in refused:  # "identical" would bless what scan fails for its safety
        say(refusal_line(inv, found, "diff"))
    if refused:
        return exitcodes.FINDINGS
    result = run_diff(*inventories, tolerance=tolerance, values=not no_values)
    if fmt == "html":
        from .render.html import render_diff

        emit(render_diff(result), output)
    else:
        from .render.diff import render_json, render_text

        emit(render_json(result) if fmt == "json" else render_text(result, verbose=verbose), output)
    return exitcodes.for_diff(result)


@app.command()
@exits
def convert(
    sources: Annotated[
        list[str],
        typer.Argument(
            help="A torch.save file (.pt .pth .bin .ckpt), a safetensors file or a Hugging Face directory; several are each "
            "converted, beside themselves or into the directory -o names, in --jobs processes or on --cluster.",
            metavar="SOURCE...",
            show_default=False,
        ),
    ],
    to: Annotated[str, typer.Option("--to", "-t", help="Target dtype: fp16, bf16 or fp32.", show_default=False)],
    output: Annotated[
        Optional[str],
        typer.Option(
            "--output",
            "-o",
            help="Where to write (default: beside the source, e.g. model.fp16.pt; a URL for a remote source). A .safetensors "
            "name changes the format. With several SOURCEs, an existing directory that receives each output under its "
            "default name.",
        ),
    ] = None,
    policy: PolicyFile = None,
    preset: Preset = None,
    keep: Annotated[
        Optional[list[str]], typer.Option("--keep", "-k", help="Keep tensors matching this glob (or re:regex) as they are. Repeatable.")
    ] = None,
    include_optimizer: Annotated[
        bool, typer.Option("--include-optimizer", help="Cast optimizer state too (it is left as is by default).")
    ] = False,
    strip_optimizer: Annotated[bool, typer.Option("--strip-optimizer", help="Drop optimizer state, for a release artefact.")] = False,
    clamp: Annotated[bool, typer.Option("--clamp", help="Saturate values beyond the target's range instead of refusing.")] = False,
    keep_unsafe: Annotated[
        bool, typer.Option("--keep-unsafe", help="Keep tensors with unsafe values at their precision instead of refusing.")
    ] = False,
    max_shard_size: Annotated[
        Optional[str],
        typer.Option("--max-shard-size", help="Re-shard a safetensors directory into shards of at most this size (5GB, 500MB)."),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            "-m",
            help="The model whose module types the plan and its checks use, in any form scan --model takes (file.py:func, "
            "module:func, transformers:MODEL_TYPE, a directory with config.json).",
        ),
    ] = None,
    materialize_ties: Annotated[
        bool,
        typer.Option(
            "--materialize-ties",
            help="With a .safetensors output: write a tied tensor (GPT-2's lm_head.weight and wte) under each of its names, "
            "so that load_state_dict(load_file(PATH)) is complete. By default it is written once and the tie kept as a "
            "metadata alias, which safetensors.torch.load_model (or strict=False plus tie_weights()) restores.",
        ),
    ] = False,
    keep_quantized: Annotated[
        bool,
        typer.Option(
            "--keep-quantized",
            help="On a quantized checkpoint: keep its quantized weights (values, scales, quantization_config) byte for byte "
            "and cast only the rest, instead of dequantizing them.",
        ),
    ] = False,
    fp8_reference: Annotated[
        Optional[str],
        typer.Option(
            "--fp8-reference",
            help="On an FP8 block-quantized checkpoint: the reference (transformers or deepseek) to dequantize by where "
            "the two read a weight differently. transformers: from_pretrained's, each block the weight's size over the "
            "scale grid's (it must divide exactly). deepseek: DeepSeek-V3's weight_dequant, blocks of the config's "
            "weight_block_size, partial at the bottom and right edges. They differ where that block does not divide the "
            "weight: 200 rows over a grid of 2 are 100-row blocks to from_pretrained, 128 and 72 to DeepSeek; 576 over 5 "
            "(DeepSeek-V3's kv_a_proj_with_mqa) from_pretrained refuses, DeepSeek reads. scan names both; without this "
            "option convert refuses such a weight (exit 2).",
            metavar="REF",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", help="Show the plan (casts, sizes, refusals), from the headers alone; write nothing.")
    ] = False,
    check_values: Annotated[
        bool,
        typer.Option(
            "--check-values",
            help="With --dry-run: read every value too, as a conversion does (NaN/Inf, overflow, underflow, the cast's "
            "errors), with a progress bar on a terminal.",
        ),
    ] = False,
    target: Annotated[
        Optional[str],
        typer.Option(
            "--target",
            help="With --dry-run: check the planned output against a hardware target (`dtypeaudit targets`); a dtype the "
            "target cannot compute fails the run (exit 1), one it emulates is a warning.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    jobs: Annotated[
        Optional[int], typer.Option("--jobs", "-j", help="With several SOURCEs: conversions run at once, in local processes (default 1).")
    ] = None,
    cluster: Cluster = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="Replace the source itself (atomically).")] = False,
    exclude: Exclude = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text or json.")] = "text",
    verbose: Verbose = False,
    debug: Debug = False,
) -> int:
    """Rewrite a checkpoint in fp16, bf16 or fp32, keeping every non-tensor byte, ties and views.

    A checkpoint that scan flags as an error (a code-running global, a pickled whole model, an index
    that disagrees with its shards) or that hides bytes after its pickle is refused (exit 2): a
    rewrite must never launder a payload. The plan keeps each module's floating tensors in one dtype
    (--keep fc.weight keeps fc.bias too) and tied tensors together, and the planned output must pass
    scan with the same policy and every built-in check, or nothing is written (exit 1). Values are
    checked next: overflow, NaN/Inf or heavy underflow refuse the conversion (exit 1) unless --clamp or
    --keep-unsafe. The output is written to a temporary file, verified (sampled records recast by torch
    where it is installed, else by numpy, and the last line says which), then renamed into place. The source
    is never touched. A quantized checkpoint (FP8, compressed-tensors, MXFP4, GPTQ, AWQ, bitsandbytes,
    GGUF) is dequantized on the CPU, shard by shard: scales and zero points are dropped and
    config.json loses its quantization_config; a scheme that cannot be dequantized exactly is refused (exit 2).

    \b
    Examples:
      dtypeaudit convert model.pt --to fp16
      dtypeaudit convert ./llama-dir --to bf16 -o ./llama-bf16
      dtypeaudit convert ./qwen3-fp8 --to bf16 -o ./qwen3-bf16
      dtypeaudit convert model.bin --to fp16 -o model.safetensors
      dtypeaudit convert model.pt --to fp16 --preset fp16-mixed
      dtypeaudit convert model.pt --to fp16 --dry-run
      dtypeaudit convert model.pt --to fp16 --dry-run --check-values
      dtypeaudit convert model.pt --to bf16 --dry-run --target t4
      dtypeaudit convert runs/*/final.pt --to bf16 --jobs 4
      dtypeaudit convert /shared/ft-*/ --to bf16 --cluster tcp://scheduler:8786
    """
    from .conversion import convert as run_convert
    from .options import convert_settings
    from .render.convert import refusal_lines, render_json, render_text

    if fmt not in ("text", "json"):
        raise UsageError(f"--format must be text or json, not '{fmt}'")
    if target is not None and (len(sources) > 1 or jobs is not None or cluster is not None):
        raise UsageError("--target checks one plan: give one SOURCE")
    # every option resolved and checked once, before any source is opened
    settings = convert_settings(
        to,
        policy=policy,
        preset=preset,
        target=target,
        keep=tuple(keep or ()),
        include_optimizer=include_optimizer,
        strip_optimizer=strip_optimizer,
        clamp=clamp,
        keep_unsafe=keep_unsafe,
        dry_run=dry_run,
        read_values=check_values,
        force=force,
        in_place=in_place,
        max_shard_size=max_shard_size,
        model=model,
        materialize_ties=materialize_ties,
        keep_quantized=keep_quantized,
        output=output,
        exclude=tuple(exclude or ()),
        fp8_reference=fp8_reference,
    )
    if len(sources) > 1 or jobs is not None or cluster is not None:
        return convert_many(sources, output, settings, jobs=jobs, cluster=cluster, as_json=fmt == "json", verbose=verbose, debug=debug)
    (source,) = sources
    progress = ByteProgress() if sys.stderr.isatty() else None
    try:
        result = run_convert(source, settings=settings, output=output, progress_factory=progress)
    finally:
        if progress is not None:
            progress.close()
    checked = settings.hardware if not result.refused else None
    unfit = False
    if fmt == "json":
        section = None
        if checked is not None:
            from .hardware import plan_json

            section, unfit = plan_json(result.plan.output_inventory(), checked, fail_on=settings.fail_on)
        emit(render_json(result, hardware_target=section), None)
    else:
        text = render_text(result, verbose=verbose)
        if checked is not None:
            from .hardware import plan_report

            text, unfit = plan_report(text, result.plan.output_inventory(), checked, fail_on=settings.fail_on)
        emit(text, None)
    for line in refusal_lines(result):
        say(f"dtypeaudit: {line}")
    return exitcodes.for_result(result, unfit=unfit)


@app.command()
@exits
def trace(
    model: Annotated[
        str,
        typer.Argument(
            help="The model: a factory (path/to/file.py:func or package.module:func; it runs, it is your code), "
            "transformers:MODEL_TYPE (e.g. transformers:gpt2, its default config), or a directory with config.json / a "
            "config.json.",
            metavar="MODEL",
            show_default=False,
        ),
    ],
    checkpoint: Annotated[
        Optional[str],
        typer.Option(
            "--checkpoint",
            "-c",
            help="Give every parameter and buffer the dtype this checkpoint stores, as load_state_dict(assign=True) would. "
            "Read by dtypeaudit's own readers: no tensor bytes, no checkpoint code. A model directory with weights is "
            "its own checkpoint.",
        ),
    ] = None,
    inputs: Annotated[
        Optional[list[str]],
        typer.Option(
            "--input",
            "-i",
            help="An input as [NAME=]SHAPE[:DTYPE]: 8x3x224x224:float16, input_ids=1x128:int64, scalar:float32. Repeatable; "
            "unnamed ones are positional. Default dtype: int64 for *ids/labels/mask, else the default dtype. Hugging "
            "Face models default to input_ids=1x128.",
        ),
    ] = None,
    input_factory: Annotated[
        Optional[str],
        typer.Option(
            "--input-factory",
            help="file.py:func returning the inputs (a tensor, a tuple, a dict or (args, kwargs)); called under fake tensors.",
        ),
    ] = None,
    autocast: Annotated[
        Optional[str],
        typer.Option("--autocast", help="Run under torch.autocast with this dtype: fp16 or bf16. CPU autocast rules (the device traced)."),
    ] = None,
    backward: Annotated[
        bool,
        typer.Option("--backward", help="Also compute a loss and its backward pass: the loss dtype, backward operations, gradient dtypes."),
    ] = False,
    loss: Annotated[
        str,
        typer.Option(
            "--loss",
            help="With --backward: auto (the model's own loss, e.g. a Hugging Face model given labels=input_ids, else sum), "
            "sum, mean or cross-entropy (the output as logits, last dim classes).",
        ),
    ] = "auto",
    default_dtype: Annotated[
        Optional[str],
        typer.Option("--default-dtype", help="torch.set_default_dtype for building and running the model (float64, bfloat16 ...)."),
    ] = None,
    allow_promotion: Annotated[
        Optional[list[str]],
        typer.Option(
            "--allow-promotion",
            help="Module paths whose implicit promotion is meant (globs as in policies: '*.norm', 're:^layers\\.\\d+\\.ln'). "
            "Repeatable; adds to the policy's trace: allow_promotion.",
        ),
    ] = None,
    policy: PolicyFile = None,
    preset: Preset = None,
    hardware: Annotated[
        Optional[str],
        typer.Option(
            "--target",
            help="A hardware target (`dtypeaudit targets`: t4, v100, a100, h100, mi300, mps, cpu, sm_XY ...): each module "
            "whose operations compute in a dtype it cannot compute is an error (unsupported-dtype), one it only "
            "emulates a warning (emulated-dtype); parameters and buffers too. Default: the policy's `target`.",
        ),
    ] = None,
    fmt: Format = None,
    output: ReportFile = None,
    fail_on: Annotated[
        Optional[str],
        typer.Option(
            "--fail-on",
            help="Lowest finding severity that makes the run exit 1: error, warning or info. Default: the policy's trace: "
            "fail_on, else its fail_on, else error.",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every module and every operation.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Each model's headline and findings only, then the verdict: for CI logs.")
    ] = False,
    debug: Debug = False,
) -> int:
    """Predict the dtype of every operation of a forward (and backward) pass, on fake tensors: no weights, no memory.

    Reports operations that fail (runtime-dtype-error, with PyTorch's message; the trace goes on and reports
    each), silent fp16/bf16-to-fp32 promotions, reductions in half precision, what autocast keeps in fp32, and
    with --backward the loss and gradient dtypes; plus input, compute and output dtypes and activation bytes per
    module. The factory runs (it is your code); nothing from a checkpoint does. Exit codes as for scan.

    \b
    Examples:
      dtypeaudit trace mymodels/net.py:build_model --input 8x3x224x224:float16
      dtypeaudit trace mymodels/net.py:build_model --checkpoint ckpt.pt --input 8x3x224x224 --autocast bf16
      dtypeaudit trace transformers:gpt2 --input input_ids=1x128:int64 --backward --format json
      dtypeaudit trace ./Llama-3-8B/ --autocast fp16 --backward --fail-on warning
      dtypeaudit trace ./Llama-3-8B/ --policy release.yaml --target t4
    """
    from .extras import require

    require("torch", "dtypeaudit trace")
    from .options import effective
    from .render.trace import renderer_for as trace_renderer_for
    from .trace import trace as run_trace

    if quiet and verbose:
        raise UsageError("give --quiet or --verbose, not both")
    chosen = effective(policy, preset=preset, target=hardware, fail_on=fail_on)
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
        fail_on=chosen.trace_fail_on,
        policy=chosen.policy,
        target=chosen.target,
    )
    emit(trace_renderer_for(chosen_format(fmt, output), width=terminal_width(), verbose=verbose, quiet=quiet)(report), output)
    return exitcodes.for_report(report)


@app.command()
@exits
def tune(
    model: Annotated[
        str,
        typer.Argument(
            help="The model: a factory (path/to/file.py:func or package.module:func; it runs, it is your code) or a "
            "Hugging Face folder (built with its class, weights from the folder).",
            metavar="MODEL",
            show_default=False,
        ),
    ],
    to: Annotated[str, typer.Option("--to", "-t", help="The low precision to tune for: fp16 or bf16.", show_default=False)],
    checkpoint: Annotated[
        Optional[str],
        typer.Option(
            "--checkpoint",
            "-c",
            help="The factory's weights: a safetensors file or a torch.save file (read with weights_only=True; no code from it "
            "runs). Tuning measures real values, so the weights you ship matter.",
        ),
    ] = None,
    input_factory: Annotated[
        Optional[str],
        typer.Option("--input-factory", help="file.py:func returning a real batch: a tensor, a tuple, a dict or (args, kwargs)."),
    ] = None,
    inputs_file: Annotated[
        Optional[str],
        typer.Option("--inputs", help="A file of input tensors, saved with torch.save or safetensors."),
    ] = None,
    specs: Annotated[
        Optional[list[str]],
        typer.Option(
            "--input",
            "-i",
            help="An input as [NAME=]SHAPE[:DTYPE], filled with seeded random data (real data is better). Repeatable.",
        ),
    ] = None,
    tolerance: Annotated[
        Optional[float],
        typer.Option(
            "--tolerance",
            help="How far the model's outputs may move from fp32, by --metric. Default: 1e-2 for fp16, 4e-2 for bf16.",
            show_default=False,
        ),
    ] = None,
    metric: Annotated[
        str,
        typer.Option(
            "--metric",
            help="max-abs-rel (the largest absolute difference over the largest fp32 output), cosine, sqnr, or your own "
            "file.py:func(out, ref) -> float.",
        ),
    ] = "max-abs-rel",
    policy_out: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            help="Write the keep set as a policy (the target dtype for everything, fp32 for the kept modules): "
            "convert --policy writes a checkpoint that follows it, scan --policy checks one, dtypeaudit.apply runs a model so.",
        ),
    ] = None,
    fmt: Annotated[
        Optional[OutputFormat],
        typer.Option("--format", "-f", help="table or plain (the modules that matter and the verdict), json (dtypeaudit.tune/1) or html."),
    ] = None,
    all_modules: Annotated[bool, typer.Option("--all", help="List every module called, not only those that matter.")] = False,
    debug: Debug = False,
) -> int:
    """Find what must stay in fp32 for MODEL to compute the same thing in fp16 or bf16, by real runs on the CPU.

    Runs the model in fp32 and in the target dtype on your inputs; measures each module's range and its own error
    (its fp32 inputs fed to its low-precision copy); finds the innermost module that overflows first; then
    searches the smallest set of modules to keep in fp32 for the outputs to stay within --tolerance, and
    verifies it by a final run. A kept module computes in fp32: its inputs are cast to fp32 on entry and its
    outputs back on exit. Exit codes: 0 a keep set passes, 1 none does (the report says which modules still
    fail), 2 bad input.

    \b
    Examples:
      dtypeaudit tune net.py:build --checkpoint model.safetensors --input-factory data.py:batch --to fp16 -o keep.yaml
      dtypeaudit convert model.safetensors --to fp16 --policy keep.yaml
      dtypeaudit tune ./my-hf-model/ --to bf16 --input input_ids=1x128:int64 --format json
    """
    from .extras import require

    require("torch", "dtypeaudit tune")
    from . import dtypes
    from .tuning import report as tune_report
    from .tuning.load import tune_from
    from .tuning.tuned_policy import policy_text

    target = dtypes.conversion_target(to)
    if target not in ("float16", "bfloat16"):
        raise UsageError(f"--to must be fp16 or bf16, not '{to}'")
    if fmt not in (None, OutputFormat.table, OutputFormat.plain, OutputFormat.json, OutputFormat.html):
        raise UsageError(f"tune writes table, plain, json or html, not {fmt.value}")
    if tolerance is not None and not tolerance > 0:
        raise UsageError(f"--tolerance must be a number > 0, not {tolerance}")
    with tune_progress() as progress:
        result = tune_from(
            model,
            to=target,
            checkpoint=checkpoint,
            input_factory=input_factory,
            inputs_file=inputs_file,
            specs=tuple(specs or ()),
            tolerance=tolerance,
            metric=metric,
            progress=progress,
        )
    chosen = chosen_format(fmt, None)
    if chosen is OutputFormat.json:
        emit(tune_report.to_json(result), None)
    elif chosen is OutputFormat.html:
        emit(tune_report.to_html(result), None)
    else:
        emit(tune_report.to_text(result, all_modules=all_modules), None)
    if policy_out is not None:
        emit(policy_text(result), policy_out, what="policy")
    return exitcodes.for_tune(result.passed)


@policy_app.command("init")
@exits
def policy_init(
    checkpoint: Annotated[
        str, typer.Argument(help="The checkpoint whose dtypes become the baseline.", metavar="CHECKPOINT", show_default=False)
    ],
    output: ReportFile = None,
    debug: Debug = False,
) -> int:
    """Write a policy that CHECKPOINT passes exactly, folded into patterns: lock today's dtypes as the baseline.

    A checkpoint that scan fails for its safety (a code-running global, trailing data) gets no baseline: one
    line names it, exit 1, nothing written.

    \b
    Example:
      dtypeaudit policy init blessed.pt > policy.yaml
      dtypeaudit scan candidate.pt --policy policy.yaml
    """
    from .baseline import render_baseline
    from .formats.locate import parse_target
    from .pipeline import read_target
    from .safety import reader_refusals, refusal_line

    named = parse_target(checkpoint)
    require_torch_for_factories([named], None, "policy init")
    inv = read_target(named)
    refused = reader_refusals(inv)
    if refused:  # a baseline would bless what scan fails for its safety: nothing written
        say(refusal_line(inv, refused, "policy init"))
        return exitcodes.FINDINGS
    emit(render_baseline(inv), output, what="policy")
    return exitcodes.CLEAN


@policy_app.command("validate")
@exits
def policy_validate(
    files: Annotated[list[str], typer.Argument(help="Policy files or preset names.", metavar="POLICY...", show_default=False)],
    debug: Debug = False,
) -> int:
    """Check policy files: exit 0 if all are valid, 2 with file:line and the valid choices if not."""
    from .policy import load_policy

    for f in files:
        pol = load_policy(f)
        extends = f", extends {' -> '.join(pol.extends)}" if pol.extends else ""
        print(f"{f}: valid ({len(pol.rules)} rules{extends}{', strict' if pol.strict else ''})")
    return exitcodes.CLEAN


@policy_app.command("presets")
@exits
def policy_presets() -> int:
    """List the shipped presets and what each expects; the aliases kept for compatibility come last."""
    from .policy import presets

    shipped = presets()
    width = max(len(p.name) for p in shipped)
    for p in shipped:
        print(f"{p.name:{width}}  {p.description}")
    return exitcodes.CLEAN


def only_the_invoked_command(args: list[str]) -> None:
    """Typer builds every command's options (signatures, type hints) on each run, a tenth of a small scan's time:
    where the first argument names a top-level command or group, register only that one. ``dtypeaudit --help`` and
    a mistyped command still see them all (benchmarks/STARTUP.md measured it)."""
    if not args:
        return

    def name(c: Any) -> str:
        return c.name or getattr(c.callback, "__name__", "").lower().replace("_", "-")

    commands = [c for c in app.registered_commands if name(c) == args[0]]
    groups = [g for g in app.registered_groups if g.name == args[0]]
    if commands or groups:
        app.registered_commands = commands
        app.registered_groups = groups


def main() -> None:
    """The console entry point (after entry.py's answer to ``--version``, and its start-up without the collector)."""
    import gc

    only_the_invoked_command(sys.argv[1:])
    gc.freeze()  # what start-up loaded stays to the end: later collections need not walk it
    gc.enable()
    leave_fast_after_torch(app)


if __name__ == "__main__":
    main()
