"""A refused conversion says why once, by cause, and a way through that works: the mixed presets on folders
whose class keeps nothing in fp32 (from_pretrained would load the plan's fp32 norms in half), and a policy that
wants in half what the class keeps in fp32 (T5's wo)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dtypeaudit import exitcodes

from .helpers import ROOT, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

torch = pytest.importorskip("torch")

_SMALL = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def gpt2() -> Any:
    tf = _tf()
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def bert() -> Any:
    tf = _tf()
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=32, max_position_embeddings=16, **_SMALL))


def vit() -> Any:
    tf = _tf()
    return tf.ViTForImageClassification(tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, **_SMALL))


def t5() -> Any:
    tf = _tf()
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))


def _inputs(model: Any) -> dict[str, Any]:
    if model.config.model_type == "vit":
        return {"pixel_values": torch.randn(1, 3, 8, 8, dtype=next(model.parameters()).dtype)}
    ids = torch.tensor([[1, 5, 7, 3]])
    return {"input_ids": ids, "decoder_input_ids": ids[:, :2]} if model.config.is_encoder_decoder else {"input_ids": ids}


def _saved(make: Callable[[], Any], path: Path) -> Path:
    torch.manual_seed(0)
    make().save_pretrained(str(path))
    return path


HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
NORMS = {"gpt2": 10, "bert": 6, "vit": 6}  # the LayerNorm tensors each tiny model holds


@pytest.mark.parametrize("to", ["fp16", "bf16"])
@pytest.mark.parametrize("make", [gpt2, bert, vit], ids=["gpt2", "bert", "vit"])
def test_a_mixed_preset_on_a_class_that_keeps_nothing(make: Callable[[], Any], to: str, tmp_path: Path) -> None:
    source = _saved(make, tmp_path / "src")
    out = tmp_path / "out"
    proc = run_cli("convert", str(source), "--to", to, "--preset", f"{to}-mixed", "-o", str(out))
    assert proc.returncode == exitcodes.FINDINGS, proc.stdout + proc.stderr  # a plan that fails its policy, as before
    assert not out.exists()
    dtype = str(HALF[to]).removeprefix("torch.")
    cause = "from_pretrained(OUT) would load these "
    assert proc.stdout.count(cause) == 1, proc.stdout  # one message for the cause, not one per tensor
    (line,) = [x for x in proc.stdout.splitlines() if cause in x]
    n = int(line.split(cause)[1].split()[0])
    assert n >= NORMS[make.__name__] and f"as {dtype}" in line and "does not keep in fp32" in line
    assert "expected float32" not in proc.stdout  # the per-tensor findings are the cause's, not repeated
    assert f"way through: --preset {to} converts the whole model to {dtype}" in proc.stdout
    assert proc.stdout.count("dtypeaudit.apply(") == 1
    # the report on stdout, one summary line on stderr
    assert proc.stderr.strip().count("\n") == 0 and "refusing to convert" in proc.stderr
    assert "the report on stdout says why and a way through" in proc.stderr
    assert cause not in proc.stderr

    # the first way through converts, and from_pretrained loads it as written
    proc = run_cli("convert", str(source), "--to", to, "--preset", to, "-o", str(out))
    assert proc.returncode == exitcodes.CLEAN, proc.stdout + proc.stderr
    loaded = type(make()).from_pretrained(str(out))
    assert {p.dtype for p in loaded.parameters()} == {HALF[to]}


def _apply_call(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if "dtypeaudit.apply(" in x]
    return line.split("without converting: ", 1)[1].split(" (loaded in float32", 1)[0]


@pytest.mark.parametrize("make", [gpt2, bert, vit], ids=["gpt2", "bert", "vit"])
def test_the_run_time_way_through_runs(make: Callable[[], Any], tmp_path: Path) -> None:
    """The suggested from_pretrained + dtypeaudit.apply, run as printed: the policy's fp32 modules hold the stored
    values in float32, the rest is float16, and the model runs."""
    import dtypeaudit

    source = _saved(make, tmp_path / "src")
    proc = run_cli("convert", str(source), "--to", "fp16", "--preset", "fp16-mixed", "-n")
    assert proc.returncode == exitcodes.FINDINGS, proc.stdout
    scope: dict[str, Any] = {"transformers": _tf(), "torch": torch, "dtypeaudit": dtypeaudit}
    exec(_apply_call(proc.stdout), scope)  # noqa: S102 - our own message, run as a user would paste it
    model = scope["model"].eval()
    stored = type(make()).from_pretrained(str(source)).state_dict()
    dtypes = {p.dtype for p in model.parameters()}
    assert {torch.float16, torch.float32} <= dtypes
    for name, t in model.state_dict().items():
        if t.dtype == torch.float32:
            assert torch.equal(t, stored[name]), name  # kept in fp32 with its stored values
    with torch.no_grad():
        assert torch.isfinite(model(**_inputs(model)).logits.float()).all()


def test_a_policy_against_what_the_class_keeps(tmp_path: Path) -> None:
    """T5 keeps wo in float32 under float16 whatever is written: fp16-mixed, which wants it in float16, cannot pass;
    the message says so once, and its way through (no policy) converts."""
    source = _saved(t5, tmp_path / "src")
    proc = run_cli("convert", str(source), "--to", "fp16", "--preset", "fp16-mixed", "-o", str(tmp_path / "out"))
    assert proc.returncode == exitcodes.FINDINGS
    assert not (tmp_path / "out").exists()
    cause = "in float32 whatever is written: T5ForConditionalGeneration's _keep_in_fp32_modules keeps them so under float16"
    assert proc.stdout.count(cause) == 1, proc.stdout
    assert "way through: without --policy or --preset" in proc.stdout
    assert "dtypeaudit.apply(" not in proc.stdout  # fp16-mixed applied to a live T5 leaves its T5LayerNorms in fp32
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("convert", str(source), "--to", "fp16", "-o", str(tmp_path / "out"))
    assert proc.returncode == exitcodes.CLEAN, proc.stdout + proc.stderr


def test_the_json_report_carries_the_causes(tmp_path: Path) -> None:
    source = _saved(gpt2, tmp_path / "src")
    proc = run_cli("convert", str(source), "--to", "fp16", "--preset", "fp16-mixed", "-n", "--format", "json")
    doc = json.loads(proc.stdout)
    (cause,) = doc["plan_causes"]
    assert len(cause["subjects"]) == len(doc["plan_failures"]) == NORMS["gpt2"]
    assert cause["ways"][0].startswith("--preset fp16 ")
    assert len(proc.stderr.strip().splitlines()) == 1


def _convert_options() -> set[str]:
    import typer

    from dtypeaudit import cli

    command = typer.main.get_command(cli.app).commands["convert"]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def test_every_option_a_refusal_names_exists(tmp_path: Path) -> None:
    """The options named by convert's refusal messages, as printed and in the code that words them."""
    texts = [(ROOT / "dtypeaudit" / "conversion" / "causes.py").read_text(), (ROOT / "dtypeaudit" / "render" / "convert.py").read_text()]
    for make, preset in ((gpt2, "fp16-mixed"), (t5, "fp16-mixed"), (bert, "bf16-mixed")):
        source = _saved(make, tmp_path / make.__name__)
        proc = run_cli("convert", str(source), "--to", preset[:4], "--preset", preset, "-n")
        texts += [proc.stdout, proc.stderr]
    named = {m for text in texts for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)}
    assert {"--preset", "--policy", "--verbose"} <= named
    assert named <= _convert_options(), named - _convert_options()


def test_findings_of_one_cause_are_one_line(tmp_path: Path) -> None:
    """Any refused plan, not only a folder's: the findings that say the same thing are one line, with a count."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    torch.save(model.state_dict(), tmp_path / "m.pt")
    policy = tmp_path / "int8.yaml"
    policy.write_text("version: 1\ndefault: float16\nrules:\n  - name: weights-int8\n    match: '*.weight'\n    dtype: int8\n")
    proc = run_cli("convert", str(tmp_path / "m.pt"), "--to", "fp16", "--policy", str(policy), "-n")
    assert proc.returncode == exitcodes.FINDINGS, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if "expected int8" in x]
    assert len(lines) == 1 and "dtype-mismatch \u00d75: " in lines[0], proc.stdout
    assert "0.weight, 1.weight, 2.weight and 2 more" in lines[0]
    assert sum("module-dtype-mix \u00d75: " in x for x in proc.stdout.splitlines()) == 1  # each weight's bias, cast apart
    assert len(proc.stderr.splitlines()) == 1 and "(10 findings, 2 causes)" in proc.stderr
