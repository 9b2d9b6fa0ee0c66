"""convert of a Hugging Face folder keeps what from_pretrained keeps: the class's ``_keep_in_fp32_modules`` under
float16 and ``_keep_in_fp32_modules_strict`` under float16 or bfloat16 stay float32, so that
``from_pretrained(output)`` is ``from_pretrained(source, dtype=target)``, bit for bit, parameter by parameter."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .helpers import run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

torch = pytest.importorskip("torch")

TO = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def t5() -> Any:
    tf = _tf()
    cfg = tf.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    return tf.T5ForConditionalGeneration(cfg)


def deepseek_v2() -> Any:
    """A MoE layer after a dense one: its router ``mlp.gate.weight`` is in ``_keep_in_fp32_modules_strict``."""
    tf = _tf()
    cfg = tf.DeepseekV2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=4,
        max_position_embeddings=16,
    )
    return tf.DeepseekV2ForCausalLM(cfg)


def gpt2() -> Any:
    tf = _tf()
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def _saved(make: Callable[[], Any], path: Path, dtype: Any = None) -> Path:
    torch.manual_seed(0)
    model = make()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path))
    return path


def _convert(source: Path, to: str, out: Path) -> str:
    proc = run_cli("convert", str(source), "--to", to, "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _state(model: Any) -> dict[str, Any]:
    """Every parameter and buffer, tied ones under each name."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _logits(model: Any) -> Any:
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids[:, :2]).logits
        return model(input_ids=ids).logits


def _assert_loads_as_from_pretrained(make: Callable[[], Any], source: Path, out: Path, to: str) -> dict[str, Any]:
    cls = type(make())
    got = cls.from_pretrained(str(out)).eval()
    want = cls.from_pretrained(str(source), dtype=TO[to]).eval()
    a, b = _state(got), _state(want)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(_logits(got), _logits(want))
    return a


@pytest.mark.parametrize(
    ("make", "to", "kept"),
    [
        (t5, "fp16", {"encoder.block.0.layer.1.DenseReluDense.wo.weight", "decoder.block.0.layer.2.DenseReluDense.wo.weight"}),
        (t5, "bf16", set()),  # _keep_in_fp32_modules applies under float16 only
        (deepseek_v2, "bf16", {"model.layers.1.mlp.gate.weight"}),
        (deepseek_v2, "fp16", {"model.layers.1.mlp.gate.weight"}),
        (gpt2, "fp16", set()),  # a class that keeps nothing: everything converts
    ],
    ids=["t5-fp16", "t5-bf16", "deepseek_v2-bf16", "deepseek_v2-fp16", "gpt2-fp16"],
)
def test_from_pretrained_of_the_output_is_from_pretrained_of_the_source(
    make: Callable[[], Any], to: str, kept: set[str], tmp_path: Path
) -> None:
    source = _saved(make, tmp_path / "src")
    report = _convert(source, to, tmp_path / "out")
    loaded = _assert_loads_as_from_pretrained(make, source, tmp_path / "out", to)
    params = [n for n, _ in make().named_parameters(remove_duplicate=False)]  # the model's names (buffers: rotary, fp32)
    assert {n for n in params if loaded[n].dtype == torch.float32} == kept
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == str(TO[to]).removeprefix("torch.")
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), "pt") as src, safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as dst:
        for name in kept:
            # copied as they are: the very bytes of the source
            assert dst.get_tensor(name).dtype == torch.float32
            assert dst.get_tensor(name).numpy().tobytes() == src.get_tensor(name).numpy().tobytes()
        stored = set(dst.keys())
    assert not {n for n in stored if n not in kept and dst_dtype(tmp_path / "out", n) == "F32"}
    if kept:
        lists = "_keep_in_fp32_modules_strict" if make is deepseek_v2 else "_keep_in_fp32_modules"
        line = f"kept in float32: {type(make()).__name__}'s {lists} (from_pretrained loads it in float32)"
        assert report.count(line) == 1, report  # one line for the list, not one per tensor
        assert "load-cast" not in report
    else:
        assert "kept in float32" not in report


def dst_dtype(folder: Path, name: str) -> str:
    header_len = int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((folder / "model.safetensors").read_bytes()[8 : 8 + header_len])
    return str(header[name]["dtype"])


def test_a_half_source_keeps_the_upcast_values(tmp_path: Path) -> None:
    """A bfloat16 T5 to float16: from_pretrained(source, dtype=float16) loads wo in float32 from its bfloat16 values,
    exactly; the output holds wo in float32 (an exact cast), not rounded to float16."""
    source = _saved(t5, tmp_path / "src", torch.bfloat16)
    report = _convert(source, "fp16", tmp_path / "out")
    loaded = _assert_loads_as_from_pretrained(t5, source, tmp_path / "out", "fp16")
    assert loaded["encoder.block.0.layer.1.DenseReluDense.wo.weight"].dtype == torch.float32
    assert report.count("kept in float32: T5ForConditionalGeneration's _keep_in_fp32_modules") == 1


def test_the_dry_run_plan_says_so(tmp_path: Path) -> None:
    source = _saved(deepseek_v2, tmp_path / "src")
    proc = run_cli("convert", str(source), "--to", "bf16", "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = (
        "kept in float32: DeepseekV2ForCausalLM's _keep_in_fp32_modules_strict (from_pretrained loads it in float32): "
        "model.layers.1.mlp.gate.weight"
    )
    assert proc.stdout.count(line) == 1, proc.stdout
    proc = run_cli("convert", str(source), "--to", "bf16", "--dry-run", "--format", "json")
    doc = json.loads(proc.stdout)
    (gate,) = [t for t in doc["tensors"] if t["name"] == "model.layers.1.mlp.gate.weight"]
    assert (gate["from"], gate["to"], gate["action"]) == ("float32", "float32", "keep")
    assert gate["reason"].startswith("kept in float32: DeepseekV2ForCausalLM's _keep_in_fp32_modules_strict")
    assert {t["to"] for t in doc["tensors"] if t["name"] != gate["name"]} == {"bfloat16"}
    assert doc["config_dtype"] == "bfloat16"


def test_scan_of_transformers_own_half_save_runs_as_it_is(tmp_path: Path) -> None:
    """from_pretrained(dtype=float16).save_pretrained() holds T5's wo in float32: the class runs it so (its
    feed-forward casts the input to wo's dtype), so a scan finds no dtype-outlier in it, and neither in convert's."""
    source = _saved(t5, tmp_path / "src")
    t5().from_pretrained(str(source), dtype=torch.float16).save_pretrained(str(tmp_path / "half"))
    _convert(source, "fp16", tmp_path / "out")
    for folder in ("half", "out"):
        proc = run_cli("scan", str(tmp_path / folder), "--format", "json")
        assert proc.returncode == 0, proc.stdout
        rules = [f["rule"] for c in json.loads(proc.stdout)["checkpoints"] for f in c["findings"]]
        assert "dtype-outlier" not in rules and "load-cast" not in rules, (folder, rules)
