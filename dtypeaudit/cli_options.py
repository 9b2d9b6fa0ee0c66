"""Every command's options, declared once, as data: the Typer app (cli.py) is built from these tables, and the
light interpreter (cli_parse.py) reads the same tables to run ``scan`` without importing Typer or Click.

Nothing here imports Typer: a table says what an option is (flags, type, default, help), cli.py turns it into
``Annotated[..., typer.Option(...)]`` and the command bodies (cli_commands.py) say what each value does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional

from .render import OutputFormat

REQUIRED: Any = ...  # an argument with no default: Typer's "Missing argument"


class Opt(NamedTuple):
    """One option (``flags`` given) or positional argument (``flags`` empty) of a command."""

    name: str  # the body's parameter name
    flags: tuple[str, ...]
    type: type = str  # str, int, float, bool (a flag), Path, or an Enum whose values are the choices
    default: Any = None  # None: optional (Optional[type]); REQUIRED: an argument that must be given
    help: str = ""
    multiple: bool = False  # repeatable option, or an argument taking every positional
    metavar: Optional[str] = None
    show_default: Optional[bool] = None  # given to Typer only when set (Typer's own default otherwise)
    callback: Optional[str] = None  # the name of a function in cli.py (Typer only: the light path declines it)
    is_eager: bool = False


class Command(NamedTuple):
    """A command: its name on the command line, its help (Click's, \\b blocks kept), its body in cli_commands.py."""

    name: str
    help: str
    params: tuple[Opt, ...]
    body: str


# -- options more than one command shares -----------------------------------------------------------

FORMAT = Opt(
    "fmt",
    ("--format", "-f"),
    OutputFormat,
    help="Output format. Default: a table on a terminal, plain text when piped.",
)
OUTPUT = Opt("output", ("--output", "-o"), Path, help="Write the report to FILE instead of stdout.")
FAIL_ON = Opt(
    "fail_on",
    ("--fail-on",),
    help="Lowest finding severity that makes the run exit 1: error, warning or info. Default: the policy's, else error.",
)
DEBUG = Opt("debug", ("--debug",), bool, False, help="Show Python tracebacks for errors.")
CLUSTER = Opt(
    "cluster",
    ("--cluster",),
    help="Run the per-checkpoint work as tasks on a Dask distributed cluster: a scheduler address (tcp://host:8786) "
    "or 'local' (a LocalCluster of --jobs worker processes). Inputs must be readable by the workers under the names given "
    "(a shared filesystem, or URLs). Needs the dask extra: pip install 'dtypeaudit[dask]'.",
)
VERBOSE = Opt("verbose", ("--verbose", "-v"), bool, False, help="List every tensor and every detail.")
QUIET = Opt(
    "quiet",
    ("--quiet", "-q"),
    bool,
    False,
    help="Findings only: no tensor or dtype tables, and no section for a checkpoint without findings (text and markdown; "
    "the pre-commit hook's default). Findings that share a rule and a cause are one row either way.",
)
POLICY = Opt("policy", ("--policy", "-p"), help="A YAML policy file (the language: docs/policies.md).")
PRESET = Opt(
    "preset",
    ("--preset",),
    help="A shipped policy by name (`dtypeaudit policy presets` lists them): fp32, fp16, bf16, fp16-weights-fp32-norms, "
    "bf16-weights-fp32-norms, amp-training. fp16-mixed and bf16-mixed are aliases of the *-weights-fp32-norms presets "
    "(half-precision weights), not Lightning's 16-mixed/bf16-mixed, whose checkpoints keep fp32 weights: use amp-training.",
)
TARGET = Opt(
    "target",
    ("--target",),
    help="A hardware target (`dtypeaudit targets` lists them: cpu, cpu-amx, t4, v100, a100, l4, h100, mi300, mps, sm_XY ...): "
    "floating dtypes it cannot compute are errors (unsupported-dtype), dtypes it only emulates warnings (emulated-dtype). "
    "Default: the policy's `target`.",
)

# -- scan ------------------------------------------------------------------------------------------------

SCAN = Command(
    "scan",
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
  dtypeaudit scan /shared/registry/ --cluster tcp://scheduler:8786 --format json -o audit.json""",
    (
        Opt(
            "targets",
            (),
            str,
            REQUIRED,
            help="Checkpoint files, model directories, globs, URLs (s3://, gs://, https://, hf://, any fsspec protocol), "
            "Hugging Face hub ids (org/name, org/name@revision: the local cache first), "
            "or a factory (path/to/file.py:func, package.module:func).",
            multiple=True,
            metavar="TARGET...",
            show_default=False,
        ),
        POLICY,
        PRESET,
        FORMAT,
        OUTPUT,
        Opt(
            "model",
            ("--model", "-m"),
            help="The model: a factory (file.py:func or module:func, returning a module or a transformers config), "
            "transformers:MODEL_TYPE, or a directory with config.json (as trace takes it); its parameters and buffers "
            "give each tensor its kind and module type. "
            "Without it, module types are guessed from names and shapes (BatchNorm, LayerNorm, RMSNorm, Linear, Conv2d, Embedding) "
            "and shown as guesses.",
        ),
        FAIL_ON,
        Opt("explain", ("--explain",), help="Show which policy rule decides tensor NAME, and why."),
        Opt(
            "values",
            ("--values",),
            bool,
            False,
            help="Also read tensor values. NaN/Inf in any floating tensor is an error. float32/float64 tensors are held to "
            "fp16's range (overflow, underflow, subnormals), unless the checkpoint holds more bf16 than fp16, which keeps "
            "fp32's range; fp16 and bf16 tensors are checked for NaN/Inf only.",
        ),
        Opt(
            "include_optimizer",
            ("--include-optimizer",),
            bool,
            False,
            help="With --values: hold optimizer state (Adam moments) to the same severities as weights. By default its "
            "value findings are info, since convert leaves optimizer state as it is.",
        ),
        Opt(
            "jobs",
            ("--jobs", "-j"),
            int,
            help="Checkpoints read in parallel, in local processes (default: one per core; 1: no workers).",
        ),
        CLUSTER,
        Opt(
            "strict",
            ("--strict",),
            bool,
            False,
            help="Fail on anything a loader might read differently from dtypeaudit, for security-sensitive gates: "
            "loader-divergence, foreign-global, trailing-data and unused-weights findings become errors. "
            "Default: the policy's `strict`, else off.",
        ),
        TARGET,
        Opt(
            "exclude",
            ("--exclude",),
            help="Leave out files matching GLOB (their path inside the folder, or their name) when a folder is walked or "
            "safety-scanned; repeatable. Every file left out is listed in a left-out note.",
            multiple=True,
            metavar="GLOB",
        ),
        VERBOSE,
        QUIET,
        DEBUG,
    ),
    body="scan",
)

# -- the other commands ---------------------------------------------------------------------------------

ROOT = Command(
    "dtypeaudit",
    """Audit and convert PyTorch checkpoint dtypes.""",
    (
        Opt(
            "version",
            ("--version",),
            bool,
            False,
            help="Print the version and exit.",
            callback="_version",
            is_eager=True,
        ),
    ),
    body="root",
)


POLICY_INIT = Command(
    "init",
    """Write a policy that CHECKPOINT passes exactly, folded into patterns: lock today's dtypes as the baseline.

\b
Example:
  dtypeaudit policy init blessed.pt > policy.yaml
  dtypeaudit scan candidate.pt --policy policy.yaml""",
    (
        Opt(
            "checkpoint",
            (),
            str,
            REQUIRED,
            help="The checkpoint whose dtypes become the baseline.",
            metavar="CHECKPOINT",
            show_default=False,
        ),
        OUTPUT,
        DEBUG,
    ),
    body="policy_init",
)


POLICY_VALIDATE = Command(
    "validate",
    """Check policy files: exit 0 if all are valid, 2 with file:line and the valid choices if not.""",
    (
        Opt(
            "files",
            (),
            str,
            REQUIRED,
            help="Policy files or preset names.",
            multiple=True,
            metavar="POLICY...",
            show_default=False,
        ),
        DEBUG,
    ),
    body="policy_validate",
)


POLICY_PRESETS = Command(
    "presets",
    """List the shipped presets and what each expects; the aliases kept for compatibility come last.""",
    (),
    body="policy_presets",
)


TARGETS = Command(
    "targets",
    """List the hardware targets and which floating dtypes each computes natively, emulates, or cannot compute.

\b
Examples:
  dtypeaudit targets
  dtypeaudit targets v100
  dtypeaudit scan model.safetensors --target v100""",
    (
        Opt(
            "name",
            (),
            str,
            None,
            help="One target (a name, an alias or sm_XY) to show in detail: why each dtype is or is not native, and the "
            "vendor documentation the row follows.",
            metavar="[NAME]",
            show_default=False,
        ),
        Opt(
            "fmt",
            ("--format", "-f"),
            str,
            "text",
            help="text, markdown or json.",
        ),
        DEBUG,
    ),
    body="targets",
)


DIFF = Command(
    "diff",
    """Compare two checkpoints: tensors added or removed, dtype, shape and value changes, ties, size.

Names match after a wrapper prefix (module., _orig_mod., state_dict., model_state_dict., model.) is
taken off either side. Values compare by the CRC-32 of each tensor's elements, or as numbers with
--tolerance. Tensors sharing a storage are shown once (a = b); a tie broken or created is listed.
Exit codes: 0 identical, 1 they differ, 2 unreadable input or misuse.

\b
Examples:
  dtypeaudit diff model.pt model.fp16.pt
  dtypeaudit diff before.pt after.pt --tolerance 1e-3
  dtypeaudit diff ddp_checkpoint.pt plain.pt --format json""",
    (
        Opt(
            "a",
            (),
            str,
            REQUIRED,
            help="The checkpoint before.",
            metavar="A",
            show_default=False,
        ),
        Opt(
            "b",
            (),
            str,
            REQUIRED,
            help="The checkpoint after.",
            metavar="B",
            show_default=False,
        ),
        Opt(
            "tolerance",
            ("--tolerance",),
            float,
            None,
            help="Compare values as numbers: tensors whose largest absolute difference is at most this are equal, across "
            "dtypes too (fp32 against its fp16 cast). Default: equal means the same bytes (CRC-32).",
            show_default=False,
        ),
        Opt(
            "no_values",
            ("--no-values",),
            bool,
            False,
            help="Compare names, dtypes, shapes and ties only; read no tensor bytes.",
        ),
        Opt(
            "fmt",
            ("--format", "-f"),
            str,
            "text",
            help="text, json or html (both dtype maps side by side).",
        ),
        OUTPUT,
        Opt(
            "verbose",
            ("--verbose", "-v"),
            bool,
            False,
            help="List every tensor; by default repeated layers are folded.",
        ),
        DEBUG,
    ),
    body="diff",
)


CONVERT = Command(
    "convert",
    """Rewrite a checkpoint in fp16, bf16 or fp32, keeping every non-tensor byte, ties and views.

A checkpoint that scan flags as an error (a code-running global, a pickled whole model, an index
that disagrees with its shards) or that hides bytes after its pickle is refused (exit 1): a
rewrite must never launder a payload. The plan keeps each module's floating tensors in one dtype
(--keep fc.weight keeps fc.bias too) and tied tensors together, and the planned output must pass
scan with the same policy and every built-in check, or nothing is written (exit 1). Values are checked next: overflow, NaN/Inf or heavy
underflow refuse the conversion (exit 1) unless --clamp or --keep-unsafe. The output is written
to a temporary file, verified against torch's own cast of the source, then renamed into place.
The source is never touched. A quantized checkpoint (FP8, compressed-tensors, MXFP4, GPTQ, AWQ,
bitsandbytes, GGUF) is dequantized on the CPU, shard by shard: scales and zero points are dropped and
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
  dtypeaudit convert /shared/ft-*/ --to bf16 --cluster tcp://scheduler:8786""",
    (
        Opt(
            "sources",
            (),
            str,
            REQUIRED,
            help="A torch.save file (.pt .pth .bin .ckpt), a safetensors file or a Hugging Face directory; several are each "
            "converted, beside themselves or into the directory -o names, in --jobs processes or on --cluster.",
            multiple=True,
            metavar="SOURCE...",
            show_default=False,
        ),
        Opt(
            "to",
            ("--to", "-t"),
            str,
            REQUIRED,
            help="Target dtype: fp16, bf16 or fp32.",
            show_default=False,
        ),
        Opt(
            "output",
            ("--output", "-o"),
            str,
            None,
            help="Where to write (default: beside the source, e.g. model.fp16.pt; a URL for a remote source). A .safetensors "
            "name changes the format. With several SOURCEs, an existing directory that receives each output under its "
            "default name.",
        ),
        POLICY,
        PRESET,
        Opt(
            "keep",
            ("--keep", "-k"),
            str,
            None,
            help="Keep tensors matching this glob (or re:regex) as they are. Repeatable.",
            multiple=True,
        ),
        Opt(
            "include_optimizer",
            ("--include-optimizer",),
            bool,
            False,
            help="Cast optimizer state too (it is left as is by default).",
        ),
        Opt(
            "strip_optimizer",
            ("--strip-optimizer",),
            bool,
            False,
            help="Drop optimizer state, for a release artefact.",
        ),
        Opt(
            "clamp",
            ("--clamp",),
            bool,
            False,
            help="Saturate values beyond the target's range instead of refusing.",
        ),
        Opt(
            "keep_unsafe",
            ("--keep-unsafe",),
            bool,
            False,
            help="Keep tensors with unsafe values at their precision instead of refusing.",
        ),
        Opt(
            "max_shard_size",
            ("--max-shard-size",),
            str,
            None,
            help="Re-shard a safetensors directory into shards of at most this size (5GB, 500MB).",
        ),
        Opt(
            "model",
            ("--model", "-m"),
            str,
            None,
            help="The model whose module types the plan and its checks use, in any form scan --model takes (file.py:func, "
            "module:func, transformers:MODEL_TYPE, a directory with config.json).",
        ),
        Opt(
            "materialize_ties",
            ("--materialize-ties",),
            bool,
            False,
            help="With a .safetensors output: write a tied tensor (GPT-2's lm_head.weight and wte) under each of its names, "
            "so that load_state_dict(load_file(PATH)) is complete. By default it is written once and the tie kept as a "
            "metadata alias, which safetensors.torch.load_model (or strict=False plus tie_weights()) restores.",
        ),
        Opt(
            "keep_quantized",
            ("--keep-quantized",),
            bool,
            False,
            help="On a quantized checkpoint: keep its quantized weights (values, scales, quantization_config) byte for byte "
            "and cast only the rest, instead of dequantizing them.",
        ),
        Opt(
            "dry_run",
            ("--dry-run", "-n"),
            bool,
            False,
            help="Show the plan (casts, sizes, refusals), from the headers alone; write nothing.",
        ),
        Opt(
            "check_values",
            ("--check-values",),
            bool,
            False,
            help="With --dry-run: read every value too, as a conversion does (NaN/Inf, overflow, underflow, the cast's "
            "errors), with a progress bar on a terminal.",
        ),
        Opt(
            "target",
            ("--target",),
            str,
            None,
            help="With --dry-run: check the planned output against a hardware target (`dtypeaudit targets`); a dtype the "
            "target cannot compute fails the run (exit 1), one it emulates is a warning.",
        ),
        Opt(
            "force",
            ("--force",),
            bool,
            False,
            help="Replace an existing output.",
        ),
        Opt(
            "jobs",
            ("--jobs", "-j"),
            int,
            None,
            help="With several SOURCEs: conversions run at once, in local processes (default 1).",
        ),
        CLUSTER,
        Opt(
            "in_place",
            ("--in-place",),
            bool,
            False,
            help="Replace the source itself (atomically).",
        ),
        Opt(
            "fmt",
            ("--format", "-f"),
            str,
            "text",
            help="text or json.",
        ),
        VERBOSE,
        DEBUG,
    ),
    body="convert",
)


TRACE = Command(
    "trace",
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
  dtypeaudit trace ./Llama-3-8B/ --policy release.yaml --target t4""",
    (
        Opt(
            "model",
            (),
            str,
            REQUIRED,
            help="The model: a factory (path/to/file.py:func or package.module:func; it runs, it is your code), "
            "transformers:MODEL_TYPE (e.g. transformers:gpt2, its default config), or a directory with config.json / a "
            "config.json.",
            metavar="MODEL",
            show_default=False,
        ),
        Opt(
            "checkpoint",
            ("--checkpoint", "-c"),
            str,
            None,
            help="Give every parameter and buffer the dtype this checkpoint stores, as load_state_dict(assign=True) would. "
            "Read by dtypeaudit's own readers: no tensor bytes, no checkpoint code. A model directory with weights is "
            "its own checkpoint.",
        ),
        Opt(
            "inputs",
            ("--input", "-i"),
            str,
            None,
            help="An input as [NAME=]SHAPE[:DTYPE]: 8x3x224x224:float16, input_ids=1x128:int64, scalar:float32. Repeatable; "
            "unnamed ones are positional. Default dtype: int64 for *ids/labels/mask, else the default dtype. Hugging "
            "Face models default to input_ids=1x128.",
            multiple=True,
        ),
        Opt(
            "input_factory",
            ("--input-factory",),
            str,
            None,
            help="file.py:func returning the inputs (a tensor, a tuple, a dict or (args, kwargs)); called under fake tensors.",
        ),
        Opt(
            "autocast",
            ("--autocast",),
            str,
            None,
            help="Run under torch.autocast with this dtype: fp16 or bf16. CPU autocast rules (the device traced).",
        ),
        Opt(
            "backward",
            ("--backward",),
            bool,
            False,
            help="Also compute a loss and its backward pass: the loss dtype, backward operations, gradient dtypes.",
        ),
        Opt(
            "loss",
            ("--loss",),
            str,
            "auto",
            help="With --backward: auto (the model's own loss, e.g. a Hugging Face model given labels=input_ids, else sum), "
            "sum, mean or cross-entropy (the output as logits, last dim classes).",
        ),
        Opt(
            "default_dtype",
            ("--default-dtype",),
            str,
            None,
            help="torch.set_default_dtype for building and running the model (float64, bfloat16 ...).",
        ),
        Opt(
            "allow_promotion",
            ("--allow-promotion",),
            str,
            None,
            help="Module paths whose implicit promotion is meant (globs as in policies: '*.norm', 're:^layers\\.\\d+\\.ln'). "
            "Repeatable; adds to the policy's trace: allow_promotion.",
            multiple=True,
        ),
        POLICY,
        PRESET,
        Opt(
            "hardware",
            ("--target",),
            str,
            None,
            help="A hardware target (`dtypeaudit targets`: t4, v100, a100, h100, mi300, mps, cpu, sm_XY ...): each module "
            "whose operations compute in a dtype it cannot compute is an error (unsupported-dtype), one it only "
            "emulates a warning (emulated-dtype); parameters and buffers too. Default: the policy's `target`.",
        ),
        FORMAT,
        OUTPUT,
        Opt(
            "fail_on",
            ("--fail-on",),
            str,
            None,
            help="Lowest finding severity that makes the run exit 1: error, warning or info. Default: the policy's trace: "
            "fail_on, else its fail_on, else error.",
        ),
        Opt(
            "verbose",
            ("--verbose", "-v"),
            bool,
            False,
            help="List every module and every operation.",
        ),
        DEBUG,
    ),
    body="trace",
)

POLICY_GROUP_HELP = "Write, check and list dtype policies."

# The commands the light interpreter may run without Typer, by name.
LIGHT: dict[str, Command] = {SCAN.name: SCAN, CONVERT.name: CONVERT}
