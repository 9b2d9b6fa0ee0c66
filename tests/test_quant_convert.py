"""``convert`` on quantized checkpoints: dequantized outputs that plain ``from_pretrained`` loads as the model.

The FP8 checkpoint is a tiny Llama whose Linear weights transformers' own FP8 writer (``Fp8Quantize``, the op its
fp8 quantizer runs on save) quantized; transformers' quantize-on-load needs a GPU, so the op is called directly.
The reference is transformers loading that directory with ``FineGrainedFP8Config(dequantize=True)`` on CPU.
GPTQ: no writer installs on this CPU-only machine, so the documented layout is built here (see test_dequant.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dtypeaudit.conversion import convert

from .helpers import run_cli

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_llama(path: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.ndim > 1 else p.uniform_(0.5, 1.5)  # norms other than ones: a cast must show
    model.save_pretrained(path)
    return model


def _save_shards(state: dict[str, torch.Tensor], path: Path, split: list[set[str]]) -> None:
    """Two shards and an index, as save_pretrained shards; ``split[0]`` goes into the first."""
    from safetensors.torch import save_file

    names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: v.contiguous() for k, v in state.items() if (k in split[0]) == (i == 0)}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_dir(tmp_path_factory.mktemp("fp8"))


def make_fp8_dir(base: Path) -> Path:
    """A tiny Llama quantized by transformers' own FP8 quantizer (blocks of 128x128), in ``base / "fp8"``."""
    from safetensors.torch import load_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    _tiny_llama(base / "bf16")
    state = load_file(base / "bf16" / "model.safetensors")
    qconfig = FineGrainedFP8Config(weight_block_size=[128, 128])
    writer = Fp8Quantize(SimpleNamespace(quantization_config=qconfig))
    for name in [k for k in state if k.endswith(".weight") and any(p in k for p in LINEAR)]:
        state.update(writer._quantize_one(name, state.pop(name)))
    out = base / "fp8"
    out.mkdir()
    # layer 0's weights in the first shard, their scales (and everything else) in the second: a logical weight
    # whose storage spans shards
    _save_shards(state, out, [{k for k in state if ".layers.0." in k and k.endswith(".weight") and "norm" not in k}])
    config = json.loads((base / "bf16" / "config.json").read_text())
    config["quantization_config"] = qconfig.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (base / "bf16" / extra).exists():
            (out / extra).write_bytes((base / "bf16" / extra).read_bytes())
    return out


def _logits(path: Path, **kw: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kw)
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.no_grad():
        return model(ids).logits


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow
def test_fp8_dir_dequantizes_to_what_transformers_loads(fp8_dir: Path, tmp_path: Path) -> None:
    from transformers import FineGrainedFP8Config

    out = tmp_path / "bf16"
    proc = run_cli("convert", str(fp8_dir), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "14 dequantized" in proc.stdout and "28 dropped" in proc.stdout
    assert "fp8-e4m3 block 128x128" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    tensors = _read(out)
    assert not [k for k in tensors if "scale" in k]
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    # the reference: transformers' own dequantizing load of the FP8 directory, on CPU
    reference = _logits(fp8_dir, quantization_config=FineGrainedFP8Config(dequantize=True))
    mine = _logits(out)
    assert torch.equal(mine, reference)  # same float32 products, rounded once to bfloat16: bit-equal
    # and every weight is the reference model's
    from transformers import AutoModelForCausalLM

    ref_state = AutoModelForCausalLM.from_pretrained(
        fp8_dir, device_map="cpu", quantization_config=FineGrainedFP8Config(dequantize=True)
    ).state_dict()
    for k, v in tensors.items():
        assert torch.equal(v, ref_state[k]), k


def test_fp8_dry_run_shows_sizes_and_writes_nothing(fp8_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    proc = run_cli("convert", str(fp8_dir), "--to", "fp32", "-o", str(out), "--dry-run", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    before, after = doc["nbytes"]
    fp8_bytes = sum(f.stat().st_size for f in fp8_dir.glob("*.safetensors"))
    assert abs(before - fp8_bytes) < 4096  # the shards' data (headers aside)
    # every parameter of the model in float32
    n_params = 256 * 256 * 2 + 2 * (256 * 256 * 2 + 2 * 128 * 256 + 3 * 256 * 384 + 2 * 256) + 256
    assert after == n_params * 4
    actions = {t["name"]: t["action"] for t in doc["tensors"]}
    assert actions["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "drop"
    assert [t["action"] for t in doc["tensors"] if t["name"] == "model.layers.0.self_attn.q_proj.weight"] == ["drop", "dequantize"]
    assert actions["model.norm.weight"] == "cast"
    assert not out.exists()
    text = run_cli("convert", str(fp8_dir), "--to", "fp32", "-o", str(out), "--dry-run").stdout
    assert "14 dequantized" in text and "(" in text and "x)" in text


def test_keep_quantized_keeps_storage_byte_for_byte(fp8_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "kept"
    result = convert(fp8_dir, "fp32", output=out, keep_quantized=True)
    assert result.output == out and not result.blocked
    before, after = _read(fp8_dir), _read(out)
    for k, v in before.items():
        if v.dtype == torch.float8_e4m3fn or k.endswith("weight_scale_inv"):
            assert after[k].dtype == v.dtype and torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert after[k].dtype == torch.float32 and torch.equal(after[k], v.float()), k
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["dtype"] == "float32"  # not float8_e4m3fn: the config dtype is the unquantized parts'


@pytest.mark.parametrize(("to", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fp8_convert_imports_no_torch_and_writes_the_torch_dequantizers_bytes(
    fp8_dir: Path, tmp_path: Path, to: str, dtype: torch.dtype
) -> None:
    """An FP8 block checkpoint dequantizes with numpy alone: the converting process (the CLI, as a user runs it)
    never imports torch (about 2.5 s of CPU), and every weight is what the torch dequantizer gives, cast by torch;
    the bf16 norms and embeddings are copied (to bf16) or cast as torch casts them (to fp16)."""
    from dtypeaudit.quant import dequant as dq

    out = tmp_path / to
    proc = run_cli("convert", str(fp8_dir), "--to", to, "-o", str(out), process=True, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"numpy", "dtypeaudit.npcast", "dtypeaudit.conversion.dequantize"} <= imported  # the check sees imports
    assert not [m for m in imported if m.split(".")[0] == "torch"]
    source, got = _read(fp8_dir), _read(out)
    quantized = [k for k, v in source.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) == 14 and set(got) == {k for k in source if not k.endswith("_scale_inv")}
    for name, value in source.items():
        if name in quantized:
            want = dq.fp8_block(value, source[name + "_scale_inv"], (128, 128)).to(dtype)
        elif name in got:
            assert value.dtype == torch.bfloat16
            want = value.to(dtype)
        else:
            continue
        assert got[name].dtype == dtype and torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name


def test_fp8_weight_in_many_pieces(tmp_path: Path) -> None:
    """A weight that convert dequantizes in several pieces of rows (1000 x 8320 in blocks of 125 x 128, the last
    piece short), scales in bfloat16: bit-equal to the torch dequantizer over the whole weight, for each target.
    (Partial edge blocks, which from_pretrained does not load: tests/test_quant_edges.py.)"""
    from safetensors.torch import load_file, save_file

    from dtypeaudit.quant import dequant as dq

    g = torch.Generator().manual_seed(5)
    src = tmp_path / "fp8"
    src.mkdir()
    weight = (torch.randn(1000, 8320, generator=g) * 60).to(torch.float8_e4m3fn)
    scale = (torch.rand(8, 65, generator=g) * 1e-3).to(torch.bfloat16)
    save_file({"layer.weight": weight, "layer.weight_scale_inv": scale}, src / "model.safetensors", metadata={"format": "pt"})
    config = {
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [125, 128]},
    }
    (src / "config.json").write_text(json.dumps(config))
    products = dq.fp8_block(weight, scale, (125, 128))
    for to, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        out = tmp_path / to
        proc = run_cli("convert", str(src), "--to", to, "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        got = load_file(out / "model.safetensors")["layer.weight"]
        want = products.to(dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), to


def _overflowing_fp8(fp8_dir: Path, tmp_path: Path) -> tuple[Path, str, torch.Tensor]:
    """A copy of ``fp8_dir`` with one block's scale made a million times larger: its products exceed float16's
    range. Returns the folder, the weight's name and its products (transformers' dequantization)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dtypeaudit.quant import dequant as dq

    big = tmp_path / "big"
    shutil.copytree(fp8_dir, big)
    name = "model.layers.1.mlp.down_proj.weight"
    for f in big.glob("*.safetensors"):
        state = load_file(f)
        if name + "_scale_inv" in state:
            state[name + "_scale_inv"][0, 1] *= 1e6
            save_file(state, f, metadata={"format": "pt"})
            scale = state[name + "_scale_inv"]
    return big, name, dq.fp8_block(_read(big)[name], scale, (128, 128))


def test_fp8_products_beyond_float16_get_the_casts_verdict(fp8_dir: Path, tmp_path: Path) -> None:
    """A block whose products exceed float16's range: --to fp16 refuses as a cast of the same values refuses
    (exit 1, the count of values, --clamp offered, nothing written) rather than write inf; --clamp writes them
    saturated, bit-equal to torch's clamp and cast of transformers' products; --to bf16 holds them."""
    big, name, products = _overflowing_fp8(fp8_dir, tmp_path)
    beyond = int(torch.isinf(products.to(torch.float16)).sum())
    assert beyond > 0
    proc = run_cli("convert", str(big), "--to", "fp16", "-o", str(tmp_path / "fp16"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{name}: {beyond} values beyond ±65504 would become inf" in proc.stdout
    assert "--clamp saturates" in proc.stdout
    assert not (tmp_path / "fp16").exists() and not list(tmp_path.glob(".*fp16*"))

    proc = run_cli("convert", str(big), "--to", "fp16", "--clamp", "-o", str(tmp_path / "clamped"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _read(tmp_path / "clamped")[name]
    want = products.clamp(-65504, 65504).to(torch.float16)
    assert torch.isfinite(got).all() and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert run_cli("convert", str(big), "--to", "bf16", "-o", str(tmp_path / "bf16")).returncode == 0


def test_fp8_overflow_is_refused_as_the_same_values_in_safetensors(fp8_dir: Path, tmp_path: Path) -> None:
    """The dequantized values of an FP8 weight, saved as float32 in a .safetensors file: converting either to
    fp16 is refused with the same figures (exit 1 both)."""
    from safetensors.torch import save_file

    big, name, products = _overflowing_fp8(fp8_dir, tmp_path)
    plain = tmp_path / "plain.safetensors"
    save_file({name: products.contiguous()}, plain)
    lines = []
    for src, out in ((big, tmp_path / "a"), (plain, tmp_path / "b.safetensors")):
        proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(out))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert not out.exists()
        lines.append(next(line for line in proc.stdout.splitlines() if line.strip().startswith(f"{name}:")))
    assert lines[0].split(";")[0] == lines[1].split(";")[0], lines


def test_dry_run_check_values_reads_a_quantized_sources_values(fp8_dir: Path, tmp_path: Path) -> None:
    """``--dry-run --check-values`` dequantizes and checks every value, writing nothing: the overflow is reported
    (exit 1); a plain ``--dry-run`` reads none (exit 0, and says so); the folder is left as it was."""
    big, name, _ = _overflowing_fp8(fp8_dir, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_cli("convert", str(big), "--to", "fp16", "--dry-run", "--check-values")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{name}: " in proc.stdout and "would become inf" in proc.stdout
    proc = run_cli("convert", str(big), "--to", "fp16", "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "values: not read" in proc.stdout
    proc = run_cli("convert", str(big), "--to", "bf16", "--dry-run", "--check-values")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ----------------------------------------------------------------------------------------------- GPTQ


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= q[i::per].to(torch.int64) << (i * bits)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _pack_cols(z: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    out = torch.zeros(z.shape[0], z.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= z[:, i::per].to(torch.int64) << (i * bits)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _gptq_dir(path: Path, bits: int = 4) -> dict[str, torch.Tensor]:
    """A GPTQ directory as AutoGPTQ/gptqmodel lay it out (v1 format: zeros stored minus one); returns the
    weights it stands for."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(21)
    path.mkdir()
    state: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(64, dtype=torch.float16)}
    expected = {}
    for name, (out_f, in_f) in {"model.layers.0.mlp.up_proj": (128, 64), "model.layers.0.mlp.down_proj": (64, 128)}.items():
        gs = 32
        q = torch.randint(0, 2**bits, (in_f, out_f), generator=g)
        zeros = torch.randint(1, 2**bits, (in_f // gs, out_f), generator=g)
        scales = (torch.rand(in_f // gs, out_f, generator=g) * 0.01).half()
        state[f"{name}.qweight"] = _pack_rows(q, bits) if 32 % bits == 0 else torch.zeros(in_f * bits // 32, out_f, dtype=torch.int32)
        state[f"{name}.qzeros"] = (
            _pack_cols(zeros - 1, bits) if 32 % bits == 0 else torch.zeros(in_f // gs, out_f * bits // 32, dtype=torch.int32)
        )
        state[f"{name}.scales"] = scales
        state[f"{name}.g_idx"] = (torch.arange(in_f) // gs).to(torch.int32)
        groups = torch.arange(in_f) // gs
        expected[f"{name}.weight"] = (scales[groups] * (q - zeros[groups])).t()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = {
        "model_type": "llama",
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False, "sym": True},
    }
    (path / "config.json").write_text(json.dumps(config))
    return expected


def test_gptq_dir_dequantizes_and_drops_its_config(tmp_path: Path) -> None:
    expected = _gptq_dir(tmp_path / "gptq")
    out = tmp_path / "bf16"
    proc = run_cli("convert", str(tmp_path / "gptq"), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    tensors = _read(out)
    assert set(tensors) == {"model.norm.weight", *expected}
    for k, w in expected.items():
        # the float16 weight the GPTQ kernel computes, then cast to bfloat16 as any float16 weight is
        assert torch.equal(tensors[k], w.to(torch.bfloat16)), k
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def test_unsupported_scheme_is_refused_and_nothing_written(tmp_path: Path) -> None:
    _gptq_dir(tmp_path / "gptq3", bits=3)
    out = tmp_path / "out"
    proc = run_cli("convert", str(tmp_path / "gptq3"), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 2, proc.stdout
    assert "3-bit GPTQ" in proc.stderr and "refused" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_missing_scale_is_refused(tmp_path: Path, fp8_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in fp8_dir.iterdir():
        if f.suffix == ".safetensors":
            state = {k: v for k, v in load_file(f).items() if k != "model.layers.1.mlp.up_proj.weight_scale_inv"}
            save_file(state, broken / f.name, metadata={"format": "pt"})
        elif f.name != "model.safetensors.index.json":
            (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight_scale_inv"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_cli("convert", str(broken), "--to", "bf16", "-o", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "model.layers.1.mlp.up_proj.weight" in proc.stderr and "lacks its scale" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_dequantize_refuses_options_that_do_not_apply(fp8_dir: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(fp8_dir), "--to", "bf16", "-o", str(tmp_path / "o"), "--keep", "lm_head*")
    assert proc.returncode == 2 and "dequantizing takes no --keep" in proc.stderr
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- compressed-tensors, MXFP4


def _ct_dir(base: Path, fmt: str, args: dict[str, Any]) -> Path:
    """A tiny Llama whose Linear layers compressed-tensors' own compressor wrote (per module, as
    ModelCompressor does), with the quantization_config its QuantizationConfig serialises."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file, save_file

    _tiny_llama(base / "bf16")
    state = load_file(base / "bf16" / "model.safetensors")
    qargs = QuantizationArgs(**args)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    compressor = BaseCompressor.load_from_registry(fmt)
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not (k.endswith(".weight") and any(p in k for p in LINEAR)):
            out[k] = v
            continue
        x = v.float()
        global_scale = generate_gparam(x.amin(), x.amax()) if qargs.strategy == "tensor_group" else None
        if qargs.strategy in ("group", "tensor_group"):
            x = x.unflatten(-1, (-1, qargs.group_size))
        lo, hi = x.amin(-1), x.amax(-1)
        if qargs.strategy == "channel":
            lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
        scale, zero = calculate_qparams(lo.to(v.dtype), hi.to(v.dtype), qargs, global_scale=global_scale)
        module = k[: -len(".weight")]
        state = {"weight": v, "weight_scale": scale, "weight_zero_point": zero}
        if global_scale is not None:
            state["weight_global_scale"] = global_scale
        packed = compressor.compress(state, scheme)
        out.update({f"{module}.{n}": t for n, t in packed.items()})
    path = base / "ct"
    path.mkdir()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "bf16" / "config.json").read_text())
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed", ignore=["lm_head"])
    config["quantization_config"] = json.loads(qconfig.model_dump_json(exclude_none=True))
    config["quantization_config"]["quant_method"] = "compressed-tensors"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _same_model(reference: Any, mine: Any) -> None:
    ref_state, my_state = reference.state_dict(), mine.state_dict()
    assert set(ref_state) == set(my_state)
    for k, v in my_state.items():
        assert torch.equal(v, ref_state[k]), k
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, reference(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "args"),
    [
        ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}),
        ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
        ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}),
    ],
)
def test_compressed_tensors_dir_matches_transformers(tmp_path: Path, fmt: str, args: dict[str, Any]) -> None:
    """The reference: transformers' compressed-tensors quantizer decompressing on load (dequantize=True)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    src = _ct_dir(tmp_path, fmt, args)
    out = tmp_path / "bf16-out"
    result = convert(src, "bf16", output=out)
    storage = {"pack-quantized": 4, "float-quantized": 2, "nvfp4-pack-quantized": 3}[fmt]  # values, scale(s), zero/shape
    assert result.plan.counts() == {"drop": 14 * storage, "dequantize": 14, "leave": 7}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(src, device_map="cpu", quantization_config=CompressedTensorsConfig(dequantize=True))
    _same_model(reference, AutoModelForCausalLM.from_pretrained(out, device_map="cpu"))


@pytest.mark.slow
def test_mxfp4_gpt_oss_matches_transformers(tmp_path: Path) -> None:
    """gpt-oss's layout (experts' ``*_blocks`` / ``*_scales``); no MXFP4 writer runs on CPU, so the blocks are
    random bytes and the scales e8m0 exponents near 1. The reference: transformers' Mxfp4Config(dequantize=True)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config

    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    g = torch.Generator().manual_seed(1)
    state = {}
    for k, v in load_file(tmp_path / "bf16" / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = v.shape  # the parameter is [E, in, out]; its blocks are [E, out, in/32, 16]
            state[k + "_blocks"] = torch.randint(0, 256, (experts, cols, rows // 32, 16), dtype=torch.uint8, generator=g)
            state[k + "_scales"] = torch.randint(118, 128, (experts, cols, rows // 32), dtype=torch.uint8, generator=g)
        else:
            state[k] = v
    src = tmp_path / "mxfp4"
    src.mkdir()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = convert(src, "bf16", output=out)
    assert result.plan.counts()["dequantize"] == 4 and result.plan.counts()["drop"] == 8
    reference = AutoModelForCausalLM.from_pretrained(src, device_map="cpu", quantization_config=Mxfp4Config(dequantize=True))
    _same_model(reference, AutoModelForCausalLM.from_pretrained(out, device_map="cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_bitsandbytes_dir_matches_transformers(tmp_path: Path, kind: str) -> None:
    """bitsandbytes' CPU backend is the writer (transformers quantizes on load and save_pretrained serialises
    the quant state); the reference is transformers loading that directory and ``model.dequantize()``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _tiny_llama(tmp_path / "bf16")
    if kind == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qconfig = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=kind == "nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=qconfig, device_map="cpu").save_pretrained(tmp_path / kind)
    out = tmp_path / "out"
    result = convert(tmp_path / kind, "bf16", output=out)
    storage_per_weight = {"nf4": 6, "fp4": 4, "int8": 3}[
        kind
    ]  # weight, absmax, quant_map, quant_state (+ nested_*); int8: weight, SCB, weight_format
    assert result.plan.counts() == {"drop": 14 * storage_per_weight, "dequantize": 14, "leave": 7}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / kind, device_map="cpu")
    reference.dequantize()
    _same_model(reference, AutoModelForCausalLM.from_pretrained(out, device_map="cpu"))


# ------------------------------------------------------------------------------------------------- GGUF


def test_gguf_to_safetensors_matches_gguf_dequantize(tmp_path: Path) -> None:
    """GGUF -> safetensors: every tensor under its GGUF name, quantized ones through gguf.quants.dequantize
    (Q8_0, Q4_0 from gguf's quantizer; Q4_K, Q5_K, Q6_K as random blocks), plain ones cast."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from .test_gguf import TENSORS, write_gguf

    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "tiny.fp32.safetensors"
    proc = run_cli("convert", str(src), "--to", "fp32", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    got = _read_file(out)
    assert set(got) == set(TENSORS)
    reader = gguf.GGUFReader(str(src))
    for t in reader.tensors:
        data = np.asarray(t.data)
        expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32))
        mine = got[t.name]
        assert mine.dtype == torch.float32 and tuple(mine.shape) == TENSORS[t.name][1], t.name
        assert torch.equal(mine.reshape(expected.shape), expected) or torch.allclose(
            mine.reshape(expected.shape), expected, equal_nan=True, rtol=0, atol=0
        ), t.name
    bad = tmp_path / "tiny.pt"
    proc = run_cli("convert", str(src), "--to", "bf16", "-o", str(bad))
    assert proc.returncode == 2 and "written as safetensors" in proc.stderr and not bad.exists()


def test_gguf_nan_from_its_blocks_is_refused_as_in_safetensors(tmp_path: Path) -> None:
    """K-quant blocks whose float16 scales are NaN/Inf dequantize to NaN/Inf: the conversion refuses them (exit 1,
    nothing written), as it refuses the same values in a .safetensors file, whatever the target; --clamp does
    not excuse them."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from safetensors.torch import save_file

    from .test_gguf import TENSORS, write_gguf

    src = write_gguf(tmp_path / "nan.gguf", finite=False)
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == "token_embd.weight")
    values = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
    bad = int((~np.isfinite(values)).sum())
    assert bad > 0
    plain = tmp_path / "plain.safetensors"
    save_file({"token_embd.weight": torch.from_numpy(values.copy())}, plain)
    for to in ("fp32", "bf16"):
        for source, out in ((src, tmp_path / f"a-{to}.safetensors"), (plain, tmp_path / f"b-{to}.safetensors")):
            proc = run_cli("convert", str(source), "--to", to, "--clamp", "-o", str(out))
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert f"token_embd.weight: {bad} NaN/Inf already present" in proc.stdout, proc.stdout
            assert not out.exists()
    assert set(TENSORS) >= {"token_embd.weight"}


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_issue_fp8_example_no_longer_casts_scales(tmp_path: Path) -> None:
    """Issue 17's example: one float8_e4m3fn weight with its weight_scale_inv, a bf16 norm, quantization_config
    fp8 [128, 128]. convert used to cast the fp32 scale to bf16, keep the FP8 weight and write float8_e4m3fn into
    config.json. Now: the weight dequantized (scale applied per block), the scale gone, the config plain bf16."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(3)
    src = tmp_path / "fp8"
    src.mkdir()
    weight = (torch.randn(256, 384, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) * 1e-3
    save_file(
        {"layer.weight": weight, "layer.weight_scale_inv": scale, "norm.weight": torch.ones(384, dtype=torch.bfloat16)},
        src / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = {
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    proc = run_cli("convert", str(src), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    got = load_file(out / "model.safetensors")
    assert set(got) == {"layer.weight", "norm.weight"}
    expected = (weight.float().reshape(2, 128, 3, 128) * scale[:, None, :, None]).reshape(256, 384).to(torch.bfloat16)
    assert torch.equal(got["layer.weight"], expected)
    written = json.loads((out / "config.json").read_text())
    assert written == {"model_type": "llama", "torch_dtype": "bfloat16"}
