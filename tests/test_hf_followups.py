"""Issue 29's follow-ups, each with the real writer and the real loader: a reader's refusals print once, grouped as
scan groups them (a real Trainer ``checkpoint-N/``, a torch.save of several code-running globals); a Trainer's
``rng_state.pth`` is judged by the loader that reads it (Trainer's ``safe_globals``); dequantizing an FP8 DeepSeek-V3
keeps what from_pretrained keeps in float32; a folder with an index and no config.json is not told of one."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .helpers import run_cli

torch = pytest.importorskip("torch")


def _tf() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# -- a real Trainer checkpoint ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .test_training_convert import _trainer

    out = tmp_path_factory.mktemp("trainer")
    _trainer(out, 2).train()
    return out / "checkpoint-2"


def _unsafe_in_training_args(checkpoint: Path) -> list[str]:
    doc = json.loads(run_cli("scan", str(checkpoint), "-f", "json").stdout)
    found = doc["checkpoints"][0]["findings"]
    return [f["message"] for f in found if f["rule"] == "unsafe-global" and f["file"] == "training_args.bin"]


def test_a_trainer_checkpoints_refusal_is_one_line_naming_the_way_through(checkpoint: Path, tmp_path: Path) -> None:
    """training_args.bin's globals (TrainingArguments and the enums it holds): one stderr line for the file and
    rule, with the count, the first globals and --exclude; the report on stdout lists the cause once; and the
    option it names passes on this command."""
    unsafe = _unsafe_in_training_args(checkpoint)
    assert len(unsafe) > 1, unsafe  # several globals: the case that printed one line each
    proc = run_cli("convert", str(checkpoint), "--to", "bf16", "-o", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    head = f"dtypeaudit: {checkpoint / 'training_args.bin'}: refusing to convert: unsafe-global \u00d7{len(unsafe)} ("
    assert line.startswith(head + "transformers.training_args.TrainingArguments, "), line
    assert "--exclude training_args.bin leaves it out" in line
    assert [x for x in proc.stdout.splitlines() if "unsafe-global" in x] == [
        f"  training_args.bin: {line.split(': refusing to convert: ', 1)[1]}"
    ]
    assert not (tmp_path / "out").exists()
    through = run_cli("convert", str(checkpoint), "--to", "bf16", "--dry-run", "--exclude", "training_args.bin")
    assert through.returncode == 0, through.stdout + through.stderr
    # scan's report groups the same findings as one row
    table = run_cli("scan", str(checkpoint), "-f", "plain").stdout
    assert table.count("unsafe-global") == 1 and f"unsafe-global \u00d7{len(unsafe)}" in table


class _Calls:
    def __init__(self, func: Any, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (self.func, (self.arg,))


def test_a_file_calling_several_globals_is_refused_in_one_line(tmp_path: Path) -> None:
    """torch.save of objects that reduce to os.system, subprocess.call and eval: one line, the three named."""
    canary = tmp_path / "canary"
    evil = tmp_path / "evil.pt"
    payload = f"touch {canary}"
    torch.save(
        {"w": torch.ones(2), "a": _Calls(os.system, payload), "b": _Calls(subprocess.call, payload), "c": _Calls(builtins.eval, "1")},
        evil,
    )
    proc = run_cli("convert", str(evil), "--to", "bf16")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    named = "unsafe-global \u00d73 (posix.system, subprocess.call, builtins.eval): "
    assert line.startswith(f"dtypeaudit: {evil}: refusing to convert: {named}"), line
    assert "can execute code when loaded" in line
    assert proc.stdout.count("unsafe-global") == 1 and "nothing was written" in proc.stdout
    assert not canary.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


# -- rng_state.pth, as its loader reads it ------------------------------------------------------------------------


def test_the_trainers_rng_state_is_judged_by_the_loader_that_reads_it(checkpoint: Path, tmp_path: Path) -> None:
    """Trainer._load_rng_state loads rng_state.pth with weights_only=True under trainer_pt_utils.safe_globals():
    the numpy globals it allow-lists are no warning there, and scan --strict passes the checkpoint. The same bytes
    under another name are read by plain torch.load(weights_only=True), which refuses them: still a warning."""
    from transformers.trainer_pt_utils import safe_globals

    from dtypeaudit.formats.allowlist import TRAINER_RNG_STATE_GLOBALS

    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals().safe_globals}
    assert allowed <= TRAINER_RNG_STATE_GLOBALS, allowed - TRAINER_RNG_STATE_GLOBALS
    rng = checkpoint / "rng_state.pth"
    with safe_globals():
        torch.load(rng, weights_only=True)  # the Trainer's own read
    with pytest.raises(Exception, match="numpy"):
        torch.load(rng, weights_only=True)  # torch.load alone refuses the numpy globals

    proc = run_cli("scan", str(checkpoint), "--exclude", "training_args.bin", "--strict", "-f", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout)["checkpoints"][0]["findings"]
    assert not [f for f in found if f["severity"] != "info"], found
    other = tmp_path / "state.pth"
    shutil.copyfile(rng, other)
    doc = json.loads(run_cli("scan", str(other), "-f", "json").stdout)
    warned = {f["message"].split(",")[0] for f in doc["checkpoints"][0]["findings"] if f["rule"] == "foreign-global"}
    assert warned and all(w.startswith("references numpy") for w in warned), warned


# -- dequantizing keeps what from_pretrained keeps in float32 -----------------------------------------------------


def _deepseek_v3_fp8(base: Path) -> Path:
    """A tiny DeepSeek-V3 saved by save_pretrained, its Linears quantized by transformers' own FP8 writer
    (Fp8Quantize, 128x128 blocks) as the released checkpoint stores them: the router's e_score_correction_bias in
    float32 (values bfloat16 cannot hold), gate.weight and the rest in bfloat16."""
    tf = _tf()
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = tf.DeepseekV3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=128,
        q_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)
    model.save_pretrained(base / "fp32")
    qconfig = tf.FineGrainedFP8Config(weight_block_size=[128, 128])
    writer = Fp8Quantize(SimpleNamespace(quantization_config=qconfig))
    state: dict[str, Any] = {}
    for k, v in load_file(base / "fp32" / "model.safetensors").items():
        if k.endswith("e_score_correction_bias"):
            state[k] = v
            continue
        linear = k.endswith(".weight") and v.ndim == 2 and not k.endswith(("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight"))
        state.update(writer._quantize_one(k, v.to(torch.bfloat16)) if linear else {k: v.to(torch.bfloat16)})
    out = base / "fp8"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "fp32" / "config.json").read_text())
    config.update(quantization_config=qconfig.to_dict(), dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_dequantizing_keeps_deepseek_v3s_strict_fp32_tensors(tmp_path: Path) -> None:
    """convert --to bf16 of the FP8 folder: from_pretrained(OUT) equals from_pretrained(SRC,
    FineGrainedFP8Config(dequantize=True), dtype=bfloat16) bit for bit, e_score_correction_bias included (it was
    rounded to bfloat16), and the plan says why it stays float32."""
    tf = _tf()
    from safetensors.torch import load_file

    src = _deepseek_v3_fp8(tmp_path)
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = load_file(src / "model.safetensors")[bias_name]
    assert bias.dtype == torch.float32 and not torch.equal(bias, bias.to(torch.bfloat16).float())  # rounding would show
    out = tmp_path / "bf16"
    proc = run_cli("convert", str(src), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kept in float32: DeepseekV3ForCausalLM's _keep_in_fp32_modules_strict" in proc.stdout
    assert torch.equal(load_file(out / "model.safetensors")[bias_name], bias)

    def loaded(path: Path, **kw: Any) -> dict[str, Any]:
        return tf.AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu", **kw).state_dict()

    want = loaded(src, quantization_config=tf.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
    got = loaded(out)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert want[bias_name].dtype == torch.float32


# -- a folder with an index and no config.json --------------------------------------------------------------------


def _sharded_llama(path: Path, config: str) -> Path:
    """save_pretrained's sharded folder: its config.json as written (``dtype``), without its dtype (``no-dtype``),
    or gone (``none``: the index alone)."""
    tf = _tf()
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="4KB")
    assert (path / "model.safetensors.index.json").exists()
    if config == "none":
        (path / "config.json").unlink()
    elif config == "no-dtype":
        written = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")}))
    return path


@pytest.mark.parametrize("config", ["dtype", "no-dtype", "none"])
def test_a_folder_without_config_json_is_not_told_of_one(tmp_path: Path, config: str) -> None:
    """The plan names config.json's new dtype only where there is a config.json (the output has one then), and the
    reason for the dtype from_pretrained picks says there is none rather than that it names none."""
    src = _sharded_llama(tmp_path / "src", config)
    doc = json.loads(run_cli("scan", str(src), "-f", "json").stdout)
    why = doc["checkpoints"][0]["metadata"]["from_pretrained_dtype"]["why"]
    first = "the first floating tensor of model-00001-of-"
    expected = {"dtype": "config.json dtype", "no-dtype": "(config.json names no dtype)", "none": "(there is no config.json)"}
    assert why.endswith(expected[config]) and (config == "dtype") != why.startswith(first), why
    out = tmp_path / "out"
    proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    has = config != "none"
    assert ("config.json" in proc.stdout) == has, proc.stdout
    assert (out / "config.json").exists() == has
    plan = json.loads(run_cli("convert", str(src), "--to", "fp16", "--dry-run", "-f", "json").stdout)
    assert plan["config_dtype"] == ("float16" if has else None)
    if has:
        written = json.loads((out / "config.json").read_text())
        assert written.get("dtype", written.get("torch_dtype")) == "float16"


def test_the_line_leads_with_the_worst_cause_of_any_file(checkpoint: Path, tmp_path: Path) -> None:
    """A file beside the weights with bytes after its pickle (a warning that refuses) is read before
    training_args.bin: the stderr line still leads with the error, and names the other cause's file and rule."""
    from .test_convert_refuse import trailing_benign_pickle

    path = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, path)
    trailing_benign_pickle(path, tmp_path / "canary")  # path / "model.pt"
    proc = run_cli("convert", str(path), "--to", "bf16", "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"dtypeaudit: {path / 'training_args.bin'}: refusing to convert: unsafe-global "), line
    assert line.endswith("; and model.pt: trailing-data, which the report on stdout lists"), line
    rows = proc.stdout.splitlines()[1:]
    assert [r.split(":")[0] for r in rows] == ["  training_args.bin", "  model.pt"], rows
