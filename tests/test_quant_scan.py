"""Quantized checkpoints, the scan side: logical weights, reports, policies and consistency findings.

Fixtures come from the real writers where one runs on CPU here: transformers' FP8Linear (``replace_with_fp8_linear``,
whose parameters are what an FP8 checkpoint holds; quantizing on load needs a GPU, so the values are filled in),
compressed-tensors' ModelCompressor, bitsandbytes' CPU Params4bit. GPTQ, AWQ and gpt-oss MXFP4 have no writer
that runs on CPU here: their documented layouts are built by hand (see each helper).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dtypeaudit.checks import check
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.policy import load_policy
from dtypeaudit.quant.group import policy_records, view
from tests.helpers import json_report, run_cli

QUANT_RULES = {"quant-missing-scale", "quant-scale-shape", "quant-scale-dtype", "quant-ignored-module", "quant-config-mismatch"}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def rules(path: Path) -> list[tuple[str, str | None]]:
    return sorted((f.rule, f.tensor) for f in check(read_checkpoint(str(path))) if f.rule in QUANT_RULES | {"config-dtype-mismatch"})


# -- transformers fp8 ------------------------------------------------------------------------------


def llama_config(hidden: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=96,
        torch_dtype="bfloat16",
    )


def fp8_state(block: tuple[int, int] | None = (128, 128), hidden: int = 256) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of a tiny Llama whose Linears transformers' replace_with_fp8_linear turned into FP8Linear, with
    values filled in (random float8 weights, positive float32 scales), and its config.json. A hidden size that 128
    does not divide makes FP8Linear allocate a scale grid that rounds up (ceil), which from_pretrained cannot load
    (tests/test_quant_edges.py)."""
    from transformers import FineGrainedFP8Config, LlamaForCausalLM
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    cfg = llama_config(hidden)
    torch.manual_seed(0)
    qc = FineGrainedFP8Config(weight_block_size=block) if block else FineGrainedFP8Config(weight_block_size=None)
    model = replace_with_fp8_linear(LlamaForCausalLM(cfg).to(torch.bfloat16), modules_to_not_convert=["lm_head"], quantization_config=qc)
    state = {}
    for k, v in model.state_dict().items():
        if v.dtype == torch.float8_e4m3fn:
            state[k] = torch.randn(v.shape).clamp(-4, 4).to(v.dtype)
        elif k.endswith("weight_scale_inv"):
            state[k] = torch.rand(v.shape) + 0.5
        else:
            state[k] = torch.randn(v.shape).to(v.dtype)
    config = {**cfg.to_dict(), "quantization_config": json.loads(json.dumps(qc.to_dict()))}
    return state, config


@pytest.fixture(scope="module")
def fp8() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return fp8_state()


def test_fp8_logical_weights_follow_fp8linear(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    path = write_dir(tmp_path / "fp8", state, config)
    quant = view(read_checkpoint(str(path)))
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (256, 256), "self_attn.v_proj": (256, 256)}
    shapes |= {"self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256), "mlp.down_proj": (256, 512)}
    got = {(w.name, w.scheme.name, w.shape, tuple(sorted(w.storage.items())), w.dequantizes_to, w.missing) for w in quant.weights}
    want = {
        (
            f"model.layers.{i}.{p}.weight",
            "fp8-e4m3 block 128x128",
            shapes[p],
            (("scale", f"model.layers.{i}.{p}.weight_scale_inv"), ("weight", f"model.layers.{i}.{p}.weight")),
            "bfloat16",
            (),
        )
        for p in PROJ
        for i in (0, 1)
    }
    assert got == want
    q = next(w for w in quant.weights if w.name.endswith("0.self_attn.q_proj.weight"))
    assert q.bits_per_weight == round((256 * 256 + 2 * 2 * 4) * 8 / (256 * 256), 3)  # the [2, 2] fp32 scale grid
    assert quant.method == "fp8" and quant.consumed == {n for w in quant.weights for n in w.storage.values()}
    assert rules(path) == []  # the real layout: no consistency finding, no config-dtype-mismatch


def test_fp8_per_tensor_scheme(tmp_path: Path) -> None:
    state, config = fp8_state(block=None)
    assert state["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == ()
    quant = view(read_checkpoint(str(write_dir(tmp_path / "t", state, config))))
    assert {w.scheme.name for w in quant.weights} == {"fp8-e4m3 per-tensor"}
    assert rules(tmp_path / "t") == []


def issue_example(tmp_path: Path, quantization_config: dict[str, Any] | None) -> Path:
    """The issue's example: one float8 weight with its weight_scale_inv, a bf16 norm, config dtype bfloat16."""
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2),
        "model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
    }
    config: dict[str, Any] = {"torch_dtype": "bfloat16"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return write_dir(tmp_path / "issue", tensors, config)


def test_issue_fp8_example_gets_no_config_dtype_mismatch(tmp_path: Path) -> None:
    path = issue_example(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    code, report, _ = json_report("scan", str(path))
    assert code == 0
    (c,) = report["checkpoints"]
    assert c["findings"] == []
    assert c["quantized"] == [
        {
            "name": "model.layers.0.self_attn.q_proj.weight",
            "module": "model.layers.0.self_attn.q_proj",
            "scheme": "fp8-e4m3 block 128x128",
            "family": "fp8",
            "value": "float8_e4m3fn",
            "bits": 8,
            "group": [128, 128],
            "symmetric": True,
            "logical_shape": [256, 256],
            "numel": 65536,
            "dequantizes_to": "bfloat16",
            "bits_per_weight": round((65536 + 16) * 8 / 65536, 3),
            "file": "model.safetensors",
            "storage": [
                {"role": "weight", "name": "model.layers.0.self_attn.q_proj.weight"},
                {"role": "scale", "name": "model.layers.0.self_attn.q_proj.weight_scale_inv"},
            ],
            "missing": [],
        }
    ]
    quant = {t["name"]: t.get("quant") for t in c["tensors"]}
    assert quant == {
        "model.layers.0.self_attn.q_proj.weight": {
            "weight": "model.layers.0.self_attn.q_proj.weight",
            "role": "weight",
            "scheme": "fp8-e4m3 block 128x128",
        },
        "model.layers.0.self_attn.q_proj.weight_scale_inv": {
            "weight": "model.layers.0.self_attn.q_proj.weight",
            "role": "scale",
            "scheme": "fp8-e4m3 block 128x128",
        },
        "model.norm.weight": None,
    }
    assert [r["dtype"] for r in c["summary"]["by_dtype"]] == ["float8_e4m3fn", "bfloat16", "float32"]  # storage, unchanged
    assert c["by_scheme"] == [
        {
            "scheme": "fp8-e4m3 block 128x128",
            "weights": 1,
            "numel": 65536,
            "nbytes": 65536 + 16,
            "bits_per_weight": 8.002,
            "share": round(65552 / (65552 + 512), 6),
        }
    ]


def test_config_dtype_mismatch_still_fires_on_the_unquantized_parts(tmp_path: Path) -> None:
    # the rule still looks at what it should: a float16 config over bfloat16 norms is still wrong
    path = issue_example(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    findings = [f for f in check(read_checkpoint(str(path))) if f.rule == "config-dtype-mismatch"]
    assert [(f.expected, f.actual) for f in findings] == [(("float16",), "bfloat16")]


def test_text_report_shows_logical_weights_first(fp8: Any, tmp_path: Path) -> None:
    path = write_dir(tmp_path / "fp8", *fp8)
    proc = run_cli("scan", str(path), env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row = next(line for line in lines if line.startswith("model.layers.0.self_attn.q_proj.weight "))
    assert row.split()[:6] == ["model.layers.0.self_attn.q_proj.weight", "fp8-e4m3", "(block", "128x128)", "→", "bfloat16"]
    assert "[256, 256]" in row
    assert not any(line.startswith("model.layers.0.self_attn.q_proj.weight_scale_inv") for line in lines)  # folded into it
    scheme_row = next(line for line in lines if line.startswith("fp8-e4m3 block 128x128"))
    assert scheme_row.split()[3] == "14"  # seven quantized weights in each of two layers
    assert "By scheme" in proc.stdout and "By dtype" in proc.stdout


def test_unquantized_reports_are_unchanged(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "plain", {"fc.weight": torch.ones(4, 4), "fc.bias": torch.ones(4)}, {"torch_dtype": "float32"})
    code, report, _ = json_report("scan", str(path))
    (c,) = report["checkpoints"]
    assert code == 0 and "quantized" not in c and "by_scheme" not in c and all("quant" not in t for t in c["tensors"])
    text = run_cli("scan", str(path)).stdout
    assert "By scheme" not in text and "Tensors" in text
    inv = read_checkpoint(str(path))
    assert not view(inv) and policy_records(inv) is inv.tensors


# -- consistency findings on broken FP8 checkpoints ----------------------------------------------


@pytest.mark.slow  # three from_pretrained loads
def test_scale_findings_against_what_transformers_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    state, config = fp8_state(hidden=256)  # transformers' CPU Fp8Dequantize takes only shapes the blocks divide
    broken = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight_scale_inv"}
    path = write_dir(tmp_path / "broken", broken, config)
    found = [f for f in check(read_checkpoint(str(path))) if f.rule in QUANT_RULES]
    assert [(f.rule, f.severity, f.tensor) for f in found] == [("quant-missing-scale", "error", "model.layers.0.self_attn.k_proj.weight")]
    assert "scale" in found[0].message and "unscaled" in found[0].message
    # transformers on CPU dequantizes: the k_proj weight comes out as the raw float8 values cast, and no key is missing
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"]
    k = model.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(k, state["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16))
    q = model.model.layers[0].self_attn.q_proj.weight  # its neighbour, with a scale, is scaled
    assert not torch.equal(q, state["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    # scale grids that do not fit the 128x128 blocks: quant-scale-shape. One the weight divides is applied to the
    # wrong blocks (a [1, 2] grid over [512, 256] scales 512x128 blocks); one it does not divide is refused.
    gate = "model.layers.0.mlp.gate_proj.weight"
    wrong = {**state, gate + "_scale_inv": torch.full((1, 2), 2.0)}
    path = write_dir(tmp_path / "wrong", wrong, config)
    assert rules(path) == [("quant-scale-shape", gate + "_scale_inv")]
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, (state[gate].float() * 2).to(torch.bfloat16))
    path = write_dir(tmp_path / "refused", {**state, gate + "_scale_inv": torch.ones(3, 2)}, config)
    assert rules(path) == [("quant-scale-shape", gate + "_scale_inv")]
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(str(path))


def test_scale_shape_and_dtype_findings(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    broken = dict(state)
    broken["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(2, 3)  # 3 does not divide [512, 256]'s 256
    broken["model.layers.0.mlp.up_proj.weight_scale_inv"] = state["model.layers.0.mlp.up_proj.weight_scale_inv"].to(torch.bfloat16)
    path = write_dir(tmp_path / "broken", broken, config)
    found = [f for f in check(read_checkpoint(str(path))) if f.rule in QUANT_RULES]
    assert sorted((f.rule, f.tensor, f.expected, f.actual) for f in found) == [
        ("quant-scale-dtype", "model.layers.0.mlp.up_proj.weight_scale_inv", ("float32", "float8_e8m0fnu", "uint8"), "bfloat16"),
        ("quant-scale-shape", "model.layers.0.mlp.gate_proj.weight_scale_inv", None, "[2, 3]"),
    ]


def test_ignored_module_that_is_quantized_and_the_reverse(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    qc = {**config["quantization_config"], "modules_to_not_convert": ["lm_head", "o_proj"]}
    path = write_dir(tmp_path / "ignored", state, {**config, "quantization_config": qc})
    assert rules(path) == [("quant-ignored-module", f"model.layers.{i}.self_attn.o_proj.weight") for i in (0, 1)]
    # the reverse: a Linear the fp8 quantizer converts, stored bf16 without a scale
    unquant = {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.up_proj")}
    unquant["model.layers.1.mlp.up_proj.weight"] = torch.ones(512, 256, dtype=torch.bfloat16)
    path = write_dir(tmp_path / "reverse", unquant, config)
    assert rules(path) == [("quant-ignored-module", "model.layers.1.mlp.up_proj.weight")]


@pytest.mark.slow  # two from_pretrained loads
def test_ignored_module_findings_and_what_transformers_does_on_cpu(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    state, config = fp8_state(hidden=256)
    qc = {**config["quantization_config"], "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn.o_proj"]}
    path = write_dir(tmp_path / "ignored", state, {**config, "quantization_config": qc})
    assert rules(path) == [("quant-ignored-module", "model.layers.0.self_attn.o_proj.weight")]
    (finding,) = [f for f in check(read_checkpoint(str(path))) if f.rule == "quant-ignored-module"]
    assert finding.severity == "warning" and "dequantizes it anyway" in finding.message
    # what the finding says of transformers on CPU: it dequantizes the listed module all the same, silently
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    scale = state["model.layers.0.self_attn.o_proj.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = (state["model.layers.0.self_attn.o_proj.weight"].float() * scale).to(torch.bfloat16)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, want)
    # and the reverse, a Linear the fp8 config quantizes stored bf16: loaded as stored, also silently
    unquant = {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.up_proj")}
    unquant["model.layers.1.mlp.up_proj.weight"] = torch.randn(512, 256).to(torch.bfloat16)
    path = write_dir(tmp_path / "reverse", unquant, config)
    (finding,) = [f for f in check(read_checkpoint(str(path))) if f.rule == "quant-ignored-module"]
    assert (finding.severity, finding.tensor) == (
        "warning",
        "model.layers.1.mlp.up_proj.weight",
    ) and "loads it as stored" in finding.message
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, unquant["model.layers.1.mlp.up_proj.weight"])


def test_config_scheme_the_tensors_contradict(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    path = write_dir(tmp_path / "gptq", state, {**config, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    found = [f for f in check(read_checkpoint(str(path))) if f.rule == "quant-config-mismatch"]
    assert len(found) == 1 and "quant_method gptq" in found[0].message and "(and 13 more)" in found[0].message
    bare = {k: v.to(torch.bfloat16) if v.dtype == torch.float8_e4m3fn else v for k, v in state.items() if "scale" not in k}
    path = write_dir(tmp_path / "none", bare, config)
    assert ("quant-config-mismatch", None) in rules(path)


# -- compressed-tensors, written by its own compressor -------------------------------------------


def compressed(preset: str, tmp_path: Path, *, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """A two-Linear model quantized by compressed-tensors' preset scheme and compressed by ModelCompressor, saved as
    llm-compressor saves it (the state dict, and the config's quantization_config from update_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(256, 128, bias=False)
            self.lm_head = torch.nn.Linear(128, 16, bias=False)

    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=list(ignore))
    )
    for name, p in model.proj.named_parameters():
        if name.endswith("scale") and p.dtype.is_floating_point:
            p.data.copy_((torch.rand(p.shape) * 0.02 + 0.01).to(p.dtype))  # what calibration would set
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    path = tmp_path / preset
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    compressor.update_config(str(path))
    return path


CT_CASES = {
    # preset: (scheme, roles, storage dtype of the values)
    "W4A16": ("int4 compressed g128", {"packed", "scale", "shape"}),
    "W4A16_ASYM": ("int4 compressed g128 asym", {"packed", "scale", "shape", "zero"}),
    "W8A16": ("int8 compressed g128", {"packed", "scale", "shape"}),
    "W8A8": ("int8 compressed per-channel", {"weight", "scale"}),
    "FP8": ("fp8-e4m3 compressed per-tensor", {"weight", "scale", "input_scale"}),  # static activations
    "FP8_BLOCK": ("fp8-e4m3 compressed block 128x128", {"weight", "scale"}),
    "NVFP4A16": ("nvfp4", {"packed", "scale", "global_scale"}),
    "MXFP4A16": ("mxfp4", {"packed", "scale"}),
}


@pytest.mark.parametrize("preset", sorted(CT_CASES))
def test_compressed_tensors_logical_weights(preset: str, tmp_path: Path) -> None:
    path = compressed(preset, tmp_path)
    quant = view(read_checkpoint(str(path)))
    scheme, roles = CT_CASES[preset]
    assert [(w.name, w.scheme.name, w.shape, set(w.storage), w.missing) for w in quant.weights] == [
        ("proj.weight", scheme, (128, 256), roles, ())
    ]
    assert quant.method == "compressed-tensors" and quant.not_converted == ("lm_head",)
    assert rules(path) == []


def test_fp8_serving_on_compressed_tensors_output(tmp_path: Path) -> None:
    assert run_cli("scan", str(compressed("FP8_BLOCK", tmp_path)), "--policy", "fp8-serving").returncode == 0
    code, report, _ = json_report("scan", str(compressed("FP8", tmp_path)), "--policy", "fp8-serving")
    (finding,) = report["checkpoints"][0]["findings"]
    assert code == 1 and finding["tensor"] == "proj.weight" and "no-other-scheme" in finding["message"]


def test_compressed_tensors_broken(tmp_path: Path) -> None:
    path = compressed("W4A16_ASYM", tmp_path)
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    missing = write_dir(tmp_path / "missing", {k: v for k, v in state.items() if k != "proj.weight_zero_point"}, config)
    assert rules(missing) == [("quant-missing-scale", "proj.weight")]
    wrong = write_dir(tmp_path / "wrong", {**state, "proj.weight_scale": torch.ones(128, 4)}, config)
    assert rules(wrong) == [("quant-scale-shape", "proj.weight_scale")]
    config["quantization_config"]["ignore"] = ["lm_head", "proj"]
    ignored = write_dir(tmp_path / "ignored", state, config)
    assert rules(ignored) == [("quant-ignored-module", "proj.weight")]


# -- GPTQ and AWQ: documented layouts, built by hand (gptqmodel / AutoAWQ pack only on GPU) --------


def gptq_tensors(out_f: int, in_f: int, bits: int = 4, group: int = 128, *, awq: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ (gptqmodel QuantLinear): qweight [in*bits/32, out], qzeros [in/g, out*bits/32], scales [in/g, out] fp16,
    g_idx [in]. AWQ (AutoAWQ WQLinear_GEMM): qweight [in, out*bits/32], same qzeros and scales, no g_idx."""
    per = 32 // bits
    groups = in_f // group
    t = {
        "qzeros": torch.zeros(groups, out_f // per, dtype=torch.int32),
        "scales": torch.ones(groups, out_f, dtype=torch.float16),
        "bias": torch.zeros(out_f, dtype=torch.float16),
    }
    if awq:
        t["qweight"] = torch.zeros(in_f, out_f // per, dtype=torch.int32)
    else:
        t["qweight"] = torch.zeros(in_f // per, out_f, dtype=torch.int32)
        t["g_idx"] = torch.arange(in_f, dtype=torch.int32) // group
    return {f"model.layers.0.self_attn.q_proj.{k}": v for k, v in t.items()} | {"model.norm.weight": torch.ones(in_f, dtype=torch.float16)}


def test_gptq_and_awq_layouts(tmp_path: Path) -> None:
    gptq_cfg = {
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    }
    path = write_dir(tmp_path / "gptq", gptq_tensors(4096, 4096), gptq_cfg)
    (w,) = view(read_checkpoint(str(path))).weights
    assert (w.name, w.scheme.name, w.shape, w.dequantizes_to, sorted(w.storage)) == (
        "model.layers.0.self_attn.q_proj.weight",
        "int4 gptq g128 sym",
        (4096, 4096),
        "float16",
        ["g_idx", "qweight", "scale", "zero"],
    )
    assert rules(path) == []
    text = run_cli("scan", str(path), env={"COLUMNS": "200"}).stdout
    row = next(line for line in text.splitlines() if line.startswith("model.layers.0.self_attn.q_proj.weight "))
    assert " ".join(row.split()[:9]) == "model.layers.0.self_attn.q_proj.weight int4 (gptq g128 sym) → float16 [4096, 4096]"
    # the same tensors without a config are recognised from their shapes
    bare = write_dir(tmp_path / "bare", gptq_tensors(4096, 4096), {"torch_dtype": "float16"})
    assert [w.scheme.name for w in view(read_checkpoint(str(bare))).weights] == ["int4 gptq g128 sym"]
    awq_cfg = {"torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    path = write_dir(tmp_path / "awq", gptq_tensors(1024, 512, awq=True), awq_cfg)
    (w,) = view(read_checkpoint(str(path))).weights
    assert (w.scheme.name, w.shape, w.scheme.params["pack_order"]) == ("int4 awq g128", (1024, 512), "awq")
    assert rules(path) == []
    bare = write_dir(tmp_path / "awq-bare", gptq_tensors(1024, 512, awq=True), {"torch_dtype": "float16"})
    assert [(w.scheme.name, w.shape) for w in view(read_checkpoint(str(bare))).weights] == [("int4 awq g128", (1024, 512))]


def test_gptq_bits_the_tensors_contradict(tmp_path: Path) -> None:
    cfg = {"torch_dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}}
    path = write_dir(tmp_path / "gptq", gptq_tensors(512, 512, bits=4), cfg)
    found = [f for f in check(read_checkpoint(str(path))) if f.rule in QUANT_RULES]
    assert any(f.rule == "quant-config-mismatch" and "8-bit" in f.message and "4-bit" in f.message for f in found)
    assert any(f.rule == "quant-scale-shape" for f in found)  # read as 8-bit, qweight and qzeros do not fit


# -- bitsandbytes 4-bit, written by its CPU backend ----------------------------------------------


@pytest.mark.slow  # importing bitsandbytes takes seconds
def test_bitsandbytes_nf4(tmp_path: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(
        torch.randn(64, 128), requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=True
    ).to("cpu")
    state = {f"model.fc.{k}": v for k, v in layer.state_dict().items()}
    config = {
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    }
    path = write_dir(tmp_path / "nf4", state, config)
    (w,) = view(read_checkpoint(str(path))).weights
    assert (w.name, w.scheme.name, w.shape, sorted(w.storage), w.missing) == (
        "model.fc.weight",
        "nf4 blocksize 64 double-quant",
        None,
        ["absmax", "nested_absmax", "nested_quant_map", "quant_map", "quant_state", "weight"],
        (),
    )
    assert w.bits_per_weight == round(sum(v.numel() * v.element_size() for v in state.values()) * 8 / (64 * 128), 3)
    assert w.numel == 64 * 128  # the shape is in quant_state's bytes; the count is in the packing
    assert rules(path) == []
    row = next(
        line for line in run_cli("scan", str(path), env={"COLUMNS": "200"}).stdout.splitlines() if line.startswith("model.fc.weight ")
    )
    assert " ".join(row.split()[:8]) == "model.fc.weight nf4 (blocksize 64 double-quant) → float16 [8192]"
    broken = write_dir(tmp_path / "broken", {k: v for k, v in state.items() if not k.endswith(".absmax")}, config)
    assert rules(broken) == [("quant-missing-scale", "model.fc.weight")]


@pytest.mark.slow  # importing bitsandbytes takes seconds
def test_bitsandbytes_int8(tmp_path: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear8bitLt(128, 64, bias=True, has_fp16_weights=False)
    layer.load_state_dict(torch.nn.Linear(128, 64).state_dict())
    layer = layer.to("cpu")  # Int8Params quantizes on the move, on bitsandbytes' CPU backend
    state = {f"model.fc.{k}": v for k, v in layer.state_dict().items()}
    assert state["model.fc.weight"].dtype == torch.int8 and state["model.fc.SCB"].shape == (64,)
    config = {"torch_dtype": "float32", "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    path = write_dir(tmp_path / "int8", state, config)
    (w,) = view(read_checkpoint(str(path))).weights
    assert (w.name, w.scheme.name, w.shape, dict(w.storage), w.dequantizes_to) == (
        "model.fc.weight",
        "int8 bnb",
        (64, 128),
        {"weight": "model.fc.weight", "scale": "model.fc.SCB", "weight_format": "model.fc.weight_format"},
        "float32",
    )
    assert rules(path) == []
    assert rules(write_dir(tmp_path / "bad", {**state, "model.fc.SCB": torch.ones(32)}, config)) == [("quant-scale-shape", "model.fc.SCB")]


# -- MXFP4 (gpt-oss): the documented layout, built by hand ---------------------------------------


def test_mxfp4_gpt_oss_layout(tmp_path: Path) -> None:
    e, inter, hidden = 2, 64, 128
    t = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(e, 2 * inter, hidden // 32, 16, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": torch.full((e, 2 * inter, hidden // 32), 127, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(e, 2 * inter, dtype=torch.bfloat16),
        "model.layers.0.mlp.router.weight": torch.zeros(e, hidden, dtype=torch.bfloat16),
    }
    config = {
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router"]},
    }
    path = write_dir(tmp_path / "mx", t, config)
    (w,) = view(read_checkpoint(str(path))).weights
    # the loader's dequantized gate_up_proj is [E, hidden, 2*inter] (convert_moe_packed_tensors transposes)
    assert (w.name, w.module, w.scheme.name, w.shape, w.bits_per_weight) == (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts",
        "mxfp4",
        (e, hidden, 2 * inter),
        4.25,
    )
    assert rules(path) == []
    t["model.layers.0.mlp.experts.gate_up_proj_scales"] = torch.ones(e, 2 * inter, 3, dtype=torch.uint8)
    assert rules(write_dir(tmp_path / "bad", t, config)) == [("quant-scale-shape", "model.layers.0.mlp.experts.gate_up_proj_scales")]


# -- policies ------------------------------------------------------------------------------------


def test_fp8_serving_preset_on_the_fp8linear_layout(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    path = write_dir(tmp_path / "ok", state, config)
    proc = run_cli("scan", str(path), "--policy", "fp8-serving")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # lm_head quantized too: the preset says it stays unquantized
    head = dict(state)
    head["lm_head.weight"] = torch.randn(96, 256).to(torch.float8_e4m3fn)  # the scale grid ceil(96/128) x ceil(256/128)
    head["lm_head.weight_scale_inv"] = torch.ones(1, 2)
    path = write_dir(tmp_path / "head", head, config)
    code, report, _ = json_report("scan", str(path), "--policy", "fp8-serving")
    found = [(f["rule"], f["tensor"]) for f in report["checkpoints"][0]["findings"]]
    assert code == 1 and found == [("dtype-mismatch", "lm_head.weight")]
    message = report["checkpoints"][0]["findings"][0]["message"]
    assert "quantized fp8-e4m3 block 128x128" in message and "unquantized-head-embeddings-norms-router" in message


def test_fp8_serving_refuses_other_schemes(tmp_path: Path) -> None:
    cfg = {"torch_dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}}
    path = write_dir(tmp_path / "gptq", gptq_tensors(512, 512), cfg)
    code, report, _ = json_report("scan", str(path), "--policy", "fp8-serving")
    findings = {f["tensor"]: f["message"] for f in report["checkpoints"][0]["findings"]}
    assert code == 1
    # the fp16 bias and norm miss the preset's default (bfloat16 or float32); the int4 weight misses every scheme rule
    assert sorted(findings) == ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert "quantized int4 gptq g128 sym" in findings["model.layers.0.self_attn.q_proj.weight"]
    assert "no-other-scheme" in findings["model.layers.0.self_attn.q_proj.weight"]


def test_scheme_selector_and_logical_dtype(fp8: Any, tmp_path: Path) -> None:
    state, config = fp8
    path = write_dir(tmp_path / "fp8", state, config)
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: bfloat16\nrules:\n"
        "  - name: fp8-dequantizes-to-fp16\n    scheme: 'fp8-e4m3 block *'\n    match: '*.mlp.*'\n    dtype: float16\n"
        "  - name: plain-only-bf16\n    scheme: none\n    dtype: bfloat16\n"
    )
    inv = read_checkpoint(str(path))
    found = [f for f in check(inv, load_policy(str(policy))) if f.rule == "dtype-mismatch"]
    # the three MLP projections dequantize to bfloat16 (their logical dtype), not float16; the rest passes
    assert sorted(f.tensor or "" for f in found) == [
        f"model.layers.{i}.mlp.{p}.weight" for i in (0, 1) for p in ("down_proj", "gate_proj", "up_proj")
    ]
    assert all(f.actual == "bfloat16" for f in found)
    # storage tensors are not judged on their own: a float8/float32-only default would otherwise flag them
    assert not any("weight_scale_inv" in (f.tensor or "") for f in found)
    records = policy_records(inv)
    assert sum(1 for r in records if r.scheme) == 14 and len(records) == len(inv.tensors) - 14
    assert math.isclose(sum(r.nbytes for r in records), sum(t.nbytes for t in inv.tensors))


def test_quant_rules_are_in_the_catalogue() -> None:
    from dtypeaudit.rules import RULES

    assert {r: RULES[r].severity for r in QUANT_RULES} == {
        "quant-missing-scale": "error",
        "quant-scale-shape": "error",
        "quant-scale-dtype": "warning",
        "quant-ignored-module": "warning",
        "quant-config-mismatch": "error",
    }


def test_policy_scheme_and_none_validation(tmp_path: Path) -> None:
    from dtypeaudit.errors import PolicyError

    good = tmp_path / "good.yaml"
    good.write_text("version: 1\nrules:\n  - scheme: ['int4 *', none]\n    dtype: none\n")
    (rule,) = load_policy(str(good)).rules
    assert rule.dtypes == frozenset() and [m.text for m in rule.scheme] == ["int4 *", "none"]
    assert rule.selectors() == "scheme: int4 *, none"
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: none\n")
    with pytest.raises(PolicyError, match="unknown dtype 'none'"):
        load_policy(str(bad))  # the default cannot forbid everything
    bad.write_text("version: 1\nrules:\n  - dtype: any\n")
    with pytest.raises(PolicyError, match="give match, ndim, kind, module, region or scheme"):
        load_policy(str(bad))
