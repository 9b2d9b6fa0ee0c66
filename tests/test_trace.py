"""``dtypeaudit trace``: the command, its report, its findings and its answers to bad input.

Whether the predictions are right is tests/test_trace_truth.py's job (every one against a real run); here: that
each finding is raised when it should be and not otherwise, that the report keeps the ``scan`` contract, and that
input which cannot be traced gets one line and exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dtypeaudit.cli import app
from dtypeaudit.errors import UsageError
from dtypeaudit.render import OutputFormat
from dtypeaudit.render.trace import renderer_for
from dtypeaudit.trace import TraceStopped, trace, trace_module
from dtypeaudit.trace.inputs import InputSpec, parse

from . import trace_zoo as zoo
from .helpers import ROOT, run_cli

ZOO = str(Path(__file__).with_name("trace_zoo.py"))
SARIF_SCHEMA = json.loads((ROOT / "tests" / "sarif-schema-2.1.0.json").read_text())


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["trace", *args], catch_exceptions=False)


def rules(report: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in report.checkpoints[0].findings:
        out.setdefault(f.rule, []).append(f)
    return out


def traced(model: nn.Module, *inputs: str, **kw: Any) -> Any:
    return trace_module(model, inputs=list(inputs), **kw)


# -- input specs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("8x3x224x224:float16", InputSpec(None, (8, 3, 224, 224), "float16")),
        ("input_ids=1x128:int64", InputSpec("input_ids", (1, 128), "int64")),
        ("x=2x4:bf16", InputSpec("x", (2, 4), "bfloat16")),
        ("16", InputSpec(None, (16,), None)),
        ("scalar:fp32", InputSpec(None, (), "float32")),
    ],
)
def test_input_specs(spec: str, expected: InputSpec) -> None:
    assert parse(spec) == expected


@pytest.mark.parametrize("spec", ["", "8x", "x=", "1x2:fp17", "a b=1", "1x-2", "=1x2"])
def test_bad_input_specs_are_usage_errors(spec: str) -> None:
    with pytest.raises(UsageError, match="--input"):
        parse(spec)


# -- findings, each where it belongs -----------------------------------------------------------------------------------


def test_clean_model_has_no_findings() -> None:
    with torch.device("meta"):
        model = zoo.cnn("fp32")
    report = traced(model, "2x3x8x8")
    assert report.checkpoints[0].findings == ()
    summary = report.checkpoints[0].trace
    assert summary.output == ("float32",) and {m.module for m in summary.modules} >= {"", "conv1", "bn1", "fc"}
    assert dict(summary.activations)["float32"] > 0


def test_every_failure_is_reported_not_only_the_first() -> None:
    """Two broken layers, two errors with PyTorch's CPU messages; the trace goes on in the model's own dtype
    (float32 here), so the layers between them do not fail as echoes of the first."""

    class TwoBroken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = zoo.cnn("half-bn")
            self.net.fc.bias.data = self.net.fc.bias.data.double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    with torch.device("meta"):
        model = TwoBroken()
    found = rules(traced(model, "2x3x8x8:float32"))
    errors = found["runtime-dtype-error"]
    assert [f.tensor for f in errors] == ["net.bn1", "net.fc"]
    assert "mixed dtype (CPU): expect parameter to have scalar type of Float" in errors[0].message
    assert errors[0].message.endswith("went on with its inputs in float32")
    assert "self and mat2 must have the same dtype, but got Double and Float" in errors[1].message


def test_composite_failure_above_aten_is_reported_and_passed() -> None:
    """conv2d checks its bias in a composite kernel, above the dispatcher: still a finding, and the trace goes on."""
    with torch.device("meta"):
        model = zoo.cnn("forgot-half-input")
    report = traced(model, "2x3x8x8:float32")
    (error,) = rules(report)["runtime-dtype-error"]
    assert error.tensor == "conv1" and "Input type (float) and bias type (c10::Half) should be the same" in error.message
    assert report.checkpoints[0].trace.output == ("float16",)


def test_implicit_promotion_and_allow_promotion() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4).half()
            self.register_buffer("scale", torch.ones(4))  # left in float32

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale

    def build() -> nn.Module:
        with torch.device("meta"):
            return Scaled()

    (warning,) = rules(traced(build(), "2x4:float16"))["implicit-promotion"]
    assert warning.tensor == "(root)" and warning.expected == ("float16",) and warning.actual == "float32"
    assert "implicit-promotion" not in rules(traced(build(), "2x4:float16", allow_promotion=["^(root)", "re:^$"]))
    for pattern in ("(root)", "re:^$"):  # the model itself, by the name findings show or by its empty path
        assert "implicit-promotion" not in rules(traced(build(), "2x4:float16", allow_promotion=[pattern]))


def test_target_findings_count_computing_operations_only() -> None:
    """Views, conversions, fills and failed operations compute nothing; one finding per module and dtype."""
    from dtypeaudit.hardware import resolve
    from dtypeaudit.trace.result import OpRecord
    from dtypeaudit.trace.verdicts import target_findings

    def op(module: str, name: str, out: str, **kw: Any) -> OpRecord:
        return OpRecord(0, "forward", module, f"{name}.default", (out,), (out,), **kw)

    ops = [
        op("fc", "aten.t", "bfloat16", view=True),
        op("fc", "aten._to_copy", "bfloat16"),
        op("fc", "aten.ones_like", "bfloat16"),
        op("fc", "aten.addmm", "bfloat16", error="boom"),
        op("act", "aten.gelu", "bfloat16"),
        op("act", "aten.mul", "bfloat16"),
        op("act", "aten.gelu", "bfloat16"),
        op("act", "aten.add", "float32"),
        op("cast", "aten.add", "int64"),
    ]
    (found,) = target_findings(ops, resolve("t4"))
    assert found.rule == "emulated-dtype" and found.tensor == "act" and found.actual == "bfloat16"
    assert found.message.startswith("aten.gelu, aten.mul compute in bfloat16 here: bfloat16 runs emulated (slowly) on t4")
    many = [op("", f"aten.op{i}", "float8_e4m3fn") for i in range(5)]
    (fp8,) = target_findings(many, resolve("a100"))
    assert fp8.rule == "unsupported-dtype" and fp8.tensor == "(root)" and "aten.op2, and 2 more compute" in fp8.message


def test_low_precision_reduction_and_explicit_upcast() -> None:
    class Soft(nn.Module):
        def __init__(self, upcast: bool) -> None:
            super().__init__()
            self.upcast = upcast

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x, -1, dtype=torch.float32) if self.upcast else torch.softmax(x, -1)

    (warning,) = rules(traced(Soft(False), "2x8:float16"))["low-precision-reduction"]
    assert "aten._softmax reduces in float16" in warning.message and "65504" in warning.message
    assert "low-precision-reduction" not in rules(traced(Soft(True), "2x8:float16"))
    assert "low-precision-reduction" not in rules(traced(Soft(False), "2x8:float32"))


def test_autocast_fp32_names_the_cpu_rules() -> None:
    with torch.device("meta"):
        model = zoo.cnn("fp32")
    report = traced(model, "2x3x8x8", autocast="bf16", backward=True, loss="cross-entropy")
    found = rules(report)
    (info,) = found["autocast-fp32"]
    assert info.severity == "info" and "aten._log_softmax in float32" in info.message
    summary = report.checkpoints[0].trace
    assert summary.autocast == "bfloat16" and summary.device == "cpu"
    assert any(o.autocast_cast and o.outputs == ("bfloat16",) for o in summary.ops)
    assert not any(o.autocast_cast for o in traced(zoo.cnn("fp32"), "2x3x8x8").checkpoints[0].trace.ops)


def test_backward_loss_and_grads() -> None:
    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2).half()
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    with torch.device("meta"):
        model = Partly()
    report = traced(model, "2x4:float16", backward=True)
    found = rules(report)
    (loss,) = found["loss-dtype"]
    assert loss.severity == "warning" and loss.actual == "float16" and "GradScaler" in loss.message
    grads = {f.tensor: f for f in found["grad-dtype"]}
    assert set(grads) == {"used.weight", "used.bias", "unused.weight", "unused.bias"}
    assert "float16 gradients" in grads["used.weight"].message and "no gradient" in grads["unused.bias"].message
    summary = report.checkpoints[0].trace
    assert {g.name: g.grad for g in summary.grads} == {
        "used.weight": "float16",
        "used.bias": "float16",
        "unused.weight": None,
        "unused.bias": None,
    }
    assert any(o.phase == "backward" and o.module == "used" for o in summary.ops)


def test_default_dtype_reproduces_set_default_dtype() -> None:
    report = trace(f"{ZOO}:cnn_fp32", inputs=["2x3x8x8"], default_dtype="float64")
    summary = report.checkpoints[0].trace
    assert summary.default_dtype == "float64" and summary.output == ("float64",) and summary.inputs[0].dtype == "float64"
    assert {t.dtype for t in report.checkpoints[0].tensors} == {"float64", "int64"}
    assert torch.get_default_dtype() == torch.float32  # restored


def test_python_level_dtype_check_stops_with_a_finding() -> None:
    class Strict(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float16:
                raise TypeError(f"expected float16 input, got {x.dtype}")
            return x

    report = traced(Strict(), "2x2:float32")
    (error,) = rules(report)["runtime-dtype-error"]
    assert "expected float16 input" in error.message and "tracing stopped here" in error.message


# -- --checkpoint: the stored dtypes, read without running anything ---------------------------------------------------


@pytest.fixture(scope="module")
def fp32_bias_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("trace_ckpt")
    state = zoo.cnn("fp32-bias").state_dict()
    paths = {"pt": d / "net.pt", "ddp": d / "ddp.pt", "safetensors": d / "net.safetensors", "missing": d / "missing.pt"}
    torch.save(state, paths["pt"])
    torch.save({"model_state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, paths["ddp"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(paths["safetensors"]))
    torch.save({k: v for k, v in state.items() if k != "conv1.bias"}, paths["missing"])
    return paths


@pytest.mark.parametrize("kind", ["pt", "ddp", "safetensors"])
def test_checkpoint_dtypes_are_applied(fp32_bias_checkpoints: dict[str, Path], kind: str) -> None:
    report = trace(f"{ZOO}:cnn_fp32", inputs=["2x3x8x8:float16"], checkpoint=str(fp32_bias_checkpoints[kind]))
    c = report.checkpoints[0]
    assert {t.name: t.dtype for t in c.tensors}["fc.bias"] == "float32"
    assert {t.name: t.dtype for t in c.tensors}["fc.weight"] == "float16"
    (error,) = rules(report)["runtime-dtype-error"]
    assert error.tensor == "fc" and "aten.addmm" in error.message
    assert c.trace.checkpoint == str(fp32_bias_checkpoints[kind])


def test_checkpoint_missing_tensors_are_reported(fp32_bias_checkpoints: dict[str, Path]) -> None:
    report = trace(f"{ZOO}:cnn_fp32", inputs=["2x3x8x8:float16"], checkpoint=str(fp32_bias_checkpoints["missing"]))
    (missing,) = rules(report)["checkpoint-missing"]
    assert missing.tensor == "conv1.bias" and "float32" in missing.message
    assert "runtime-dtype-error" in rules(report)  # conv1.bias kept float32 beside a float16 weight


def test_checkpoint_of_another_model_is_refused(fp32_bias_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="does not fit the model: 0 of its"):
        trace(f"{ZOO}:transformer_bf16_embedding", inputs=["2x8:int64"], checkpoint=str(fp32_bias_checkpoints["pt"]))


def test_hostile_checkpoint_is_never_run(tmp_path: Path, canary: Path) -> None:
    payload = tmp_path / "evil.pt"
    script = (
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.trace_zoo import cnn\n"
        "class P:\n"
        f"    def __reduce__(self): return (os.system, ('touch {canary}',))\n"
        f"torch.save({{'state': cnn('fp32').state_dict(), 'p': P()}}, {str(payload)!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    result = cli(f"{ZOO}:cnn_fp32", "--input", "2x3x8x8", "--checkpoint", str(payload))
    assert result.exit_code == 2 and "unsafe-global" in result.stderr
    assert not canary.exists()


# -- Hugging Face: a config, offline ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 directory saved in float16 (config and safetensors weights), its LayerNorms kept in float32."""
    d = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    model = zoo.gpt2()
    model.half()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
    model.save_pretrained(d)
    return d


def test_hf_directory_uses_its_own_weights_dtypes(gpt2_dir: Path) -> None:
    report = trace(str(gpt2_dir), inputs=["input_ids=1x8"], backward=True)
    c = report.checkpoints[0]
    summary = c.trace
    assert summary.checkpoint == str(gpt2_dir) and summary.model == "GPT2LMHeadModel"
    dtypes = {t.name: t.dtype for t in c.tensors}
    assert dtypes["transformer.h.0.ln_1.weight"] == "float32" and dtypes["transformer.h.0.attn.c_attn.weight"] == "float16"
    found = rules(report)
    assert "runtime-dtype-error" not in found  # CPU LayerNorms take float16 input beside float32 weights
    assert {f.tensor for f in found["grad-dtype"]} >= {"transformer.h.0.attn.c_attn.weight"}
    assert "transformer.h.0.ln_1.weight" not in {f.tensor for f in found["grad-dtype"]}
    assert (summary.loss, summary.loss_dtype, summary.output) == ("model", "float32", ("float16",))  # its loss upcasts the logits


def test_transformers_model_type_and_config_json(gpt2_dir: Path) -> None:
    report = trace(str(gpt2_dir / "config.json"), inputs=["input_ids=1x4"])
    assert report.checkpoints[0].trace.checkpoint is None  # a config file alone: the config's dtype, no weights
    result = cli("transformers:gpt2", "--input", "input_ids=1x4", "--format", "json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["checkpoints"][0]["trace"]["model"] == "GPT2LMHeadModel"


def test_remote_code_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    result = cli(str(tmp_path), "--input", "input_ids=1x4")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert not (tmp_path / "ran").exists()


# -- bad input: one line, exit 2 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([f"{ZOO}:raises", "--input", "2x3x8x8"], ["calling 'raises()' failed", "could not find its weights"]),
        ([f"{ZOO}:cnn_fp32", "--input", "2x5x8x8"], ["tracing stopped in module 'conv1'", "expected input[2, 5, 8, 8] to have 3 channels"]),
        ([f"{ZOO}:data_dependent", "--input", "2x4"], ["tracing stopped in module 'select'", "depends on tensor values"]),
        ([f"{ZOO}:cnn_fp32", "--input", "foo=2x3x8x8"], ["unexpected keyword argument 'foo'"]),
        ([f"{ZOO}:cnn_fp32"], ["give the model's input"]),
        ([f"{ZOO}:cnn_fp32", "--input", "2x3x8x8", "--autocast", "fp32"], ["--autocast must be fp16 or bf16"]),
        ([f"{ZOO}:cnn_fp32", "--input", "2x3x8x8", "--loss", "hinge", "--backward"], ["--loss must be one of"]),
        (["not_a_model.txt"], ["is not a model"]),
        (["transformers:nosuchmodel"], ["Unrecognized model identifier: nosuchmodel"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], words: list[str]) -> None:
    result = cli(*args)
    assert result.exit_code == 2, result.stdout
    assert result.stdout == "" and result.stderr.startswith("dtypeaudit: error: ") and result.stderr.count("\n") == 1
    for w in words:
        assert w in result.stderr


def test_trace_stopped_names_the_module() -> None:
    with pytest.raises(TraceStopped) as info:
        traced(zoo.data_dependent(), "2x4")
    assert info.value.module == "select" and info.value.op == "aten.index"


# -- one report, every format, the scan contract -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_report() -> Any:
    return trace(f"{ZOO}:cnn_fp32_bias", inputs=["2x3x8x8:float16"], backward=True)


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_format_renders_a_trace(broken_report: Any, fmt: OutputFormat) -> None:
    text = renderer_for(fmt, width=120)(broken_report)
    assert "runtime-dtype-error" in text or fmt is OutputFormat.junit and "aten.addmm" in text


def test_json_has_the_trace_section(broken_report: Any) -> None:
    doc = json.loads(renderer_for(OutputFormat.json)(broken_report))
    assert doc["schema"] == "dtypeaudit.report/1"
    (c,) = doc["checkpoints"]
    assert c["format"] == "trace" and c["error"] is None and {t["name"] for t in c["tensors"]} >= {"fc.bias", "conv1.weight"}
    t = c["trace"]
    assert t["device"] == "cpu" and t["backward"] is True and t["inputs"] == [{"name": None, "shape": [2, 3, 8, 8], "dtype": "float16"}]
    assert t["ops_total"] == len(t["ops"]) and t["errors"] == sum(1 for o in t["ops"] if "error" in o)
    failing = [o for o in t["ops"] if "error" in o]
    assert failing[0]["module"] == "fc" and failing[0]["op"] == "aten.addmm.default" and failing[0]["continued_as"] == "float16"
    assert {m["module"] for m in t["modules"]} >= {"", "fc", "bn1"}
    assert sum(a["nbytes"] for a in t["activations"]) > 0
    assert {g["name"] for g in t["grads"]} >= {"fc.bias"}


def test_sarif_validates(broken_report: Any) -> None:
    doc = json.loads(renderer_for(OutputFormat.sarif)(broken_report))
    jsonschema.validate(doc, SARIF_SCHEMA)
    ids = {r["id"] for r in doc["runs"][0]["tool"]["driver"]["rules"]}
    assert {"runtime-dtype-error", "grad-dtype", "loss-dtype"} <= ids


def test_exit_codes_fail_on_and_output_file(tmp_path: Path) -> None:
    clean = cli(f"{ZOO}:cnn_fp32", "--input", "2x3x8x8", "--autocast", "bf16", "--format", "json")
    assert clean.exit_code == 0  # the pool's bfloat16 mean is a warning
    assert json.loads(clean.stdout)["checkpoints"][0]["findings"][0]["rule"] == "low-precision-reduction"
    args = [
        f"{ZOO}:cnn_fp32",
        "--input",
        "2x3x8x8",
        "--autocast",
        "bf16",
        "--fail-on",
        "warning",
        "-o",
        str(tmp_path / "r.sarif"),
        "-f",
        "sarif",
    ]
    strict = cli(*args)
    assert strict.exit_code == 1 and strict.stdout == "" and json.loads((tmp_path / "r.sarif").read_text())["version"] == "2.1.0"
    broken = cli(f"{ZOO}:cnn_forgot_half", "--input", "2x3x8x8:float32", "-f", "github")
    assert broken.exit_code == 1 and broken.stdout.startswith("::error ")
    assert cli(f"{ZOO}:cnn_fp32", "--input", "2x3x8x8", "--fail-on", "fatal").exit_code == 2


def test_text_report_folds_layers_and_verbose_lists_operations() -> None:
    # wide enough for whole rows, whatever terminal the tests run under (80 columns where there is none)
    plain = CliRunner().invoke(app, ["trace", "transformers:gpt2", "--input", "input_ids=1x4", "-f", "plain"], env={"COLUMNS": "200"})
    assert plain.exit_code == 0, plain.output
    assert any(line.startswith("transformer.h.{0..11}.attn  ×12 ") for line in plain.stdout.splitlines()), plain.stdout
    verbose = cli(f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "-f", "plain", "-v")
    assert "Operations (" in verbose.stdout and "FAILS:" in verbose.stdout and "aten.addmm" in verbose.stdout


def test_as_a_ci_step(tmp_path: Path) -> None:
    """A separate process: the report on stdout only, errors on stderr, exit 1 on findings."""
    proc = run_cli("trace", f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["checkpoints"][0]["findings"][0]["rule"] == "runtime-dtype-error"


def test_quiet_shows_the_headline_findings_and_verdict_only() -> None:
    full = run_cli("trace", f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "-f", "plain")
    quiet = run_cli("trace", f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "-f", "plain", "--quiet")
    assert quiet.returncode == full.returncode == 1
    assert "Modules" in full.stdout and "Modules" not in quiet.stdout and "Parameters and buffers" not in quiet.stdout
    assert "runtime-dtype-error" in quiet.stdout
    assert quiet.stdout.splitlines()[0] == full.stdout.splitlines()[0] and quiet.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    both = run_cli("trace", f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "-q", "-v")
    assert both.returncode == 2 and "not both" in both.stderr


def test_scan_and_import_stay_free_of_torch() -> None:
    code = "import sys, dtypeaudit.trace, dtypeaudit.render.trace; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "False"


class _AtenLog:
    """The aten operations a plain run dispatches, seen by a dispatch mode alone (which no fast path checks for)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops: list[str] = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ops.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        self.ops = ops
        self.mode = Log()


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.MultiheadAttention(8, 2, batch_first=True),
        lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
    ],
    ids=["MultiheadAttention", "TransformerEncoderLayer"],
)
def test_the_recorder_does_not_change_which_kernels_run(make: Callable[[], nn.Module]) -> None:
    """Eval-mode attention takes its fused kernel in a plain run; under the recorder it must take the same one,
    though the recorder's torch-function mode makes ``has_torch_function`` true (issue 19 item 2)."""
    from dtypeaudit.trace.record import run

    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(2, 5, 8)
    args, kwargs = ((x, x, x), {"need_weights": False}) if isinstance(model, nn.MultiheadAttention) else ((x,), {})
    log = _AtenLog()
    with torch.no_grad(), log.mode:
        model(*args, **kwargs)
    fused = {op for op in log.ops if op.startswith(("aten._native_multi_head_attention", "aten._transformer_encoder_layer"))}
    assert fused, log.ops  # the plain run takes a fused kernel on this torch
    with torch.no_grad():
        rec = run(model, args, kwargs)
    recorded = [o.op.rsplit(".", 1)[0] for o in rec.ops]
    assert [op for op in recorded if op in fused] == [op for op in log.ops if op in fused], recorded


def test_an_lstm_traces_as_it_runs() -> None:
    """mkldnn_rnn_layer's meta kernel returns a tensor where the CPU kernel leaves its workspace empty: the trace
    records the same operations and outputs as a real run (issue 19 item 2)."""
    from dtypeaudit.trace.record import run

    torch.manual_seed(0)
    model = nn.LSTM(4, 3, batch_first=True).eval()
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        real = [(o.op, o.inputs, o.outputs) for o in run(model, (x,), {}).ops]
    summary = trace_module(model, inputs=["2x5x4:float32"]).checkpoints[0].trace
    assert summary is not None
    fake = [(o.op, o.inputs, o.outputs) for o in summary.ops]
    rnn = [r for r in real if "rnn" in r[0]]
    assert rnn and rnn == [f for f in fake if "rnn" in f[0]], (real, fake)


class _DeeplyNamedEncoderStack(nn.Module):
    """Long module paths and long type names: what a narrow terminal must show whole."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_with_a_long_name = nn.ModuleDict(
            {"transformer_encoder_layers": nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder_with_a_long_name["transformer_encoder_layers"](x)


def deeply_named() -> nn.Module:
    return _DeeplyNamedEncoderStack()


@pytest.mark.parametrize("columns", ["80", "100"])
def test_narrow_terminals_cut_neither_type_names_nor_module_names(columns: str) -> None:
    """Issue 19 item 8: at 80 and 100 columns, type names stay whole and module names break only after a dot."""
    proc = run_cli("trace", "tests.test_trace:deeply_named", "--input", "1x4x8", "-f", "plain", env={"COLUMNS": columns}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= int(columns)
    start = next(i for i, line in enumerate(lines) if line.startswith("Modules"))
    section = lines[start : next(i for i in range(start + 1, len(lines)) if not lines[i].strip())]
    words = {w.strip(".,") for line in section for w in line.split()}
    for type_name in ("_DeeplyNamedEncoderStack", "Sequential", "TransformerEncoderLayer"):
        assert type_name in words, "\n".join(section)
    # every dotted component of every module name is on one line, whole
    for name in ("encoder_with_a_long_name.transformer_encoder_layers.0",):
        for component in filter(None, name.split(".")):
            assert any(component in line.split() or f"{component}." in line or f".{component}" in line for line in section), (
                component,
                "\n".join(section),
            )
