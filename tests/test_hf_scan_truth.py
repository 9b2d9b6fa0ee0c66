"""What a scan of a Hugging Face folder says against what ``from_pretrained`` really does (issue 29 items 5 and 7).

Every folder is written by ``save_pretrained`` (then edited as users' folders are: a DDP ``module.`` prefix on every
key, a stray tensor, a base model's weights under a head class) and loaded by transformers'
``from_pretrained(folder, output_loading_info=True)``: the names it reports as unexpected and missing are the
ones the scan names, from the table of transformers' classes, without importing transformers."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtypeaudit.checks import check
from dtypeaudit.formats import hfload, hftable, read_checkpoint
from dtypeaudit.policy import load_policy
from tests.helpers import run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _tiny(kind: str) -> Any:
    import transformers as T

    torch.manual_seed(0)
    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=1))
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**small, num_key_value_heads=1))
    if kind == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=1))
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    if kind == "gpt2-base":
        return T.GPT2Model(T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    if kind == "bert":
        return T.BertForMaskedLM(T.BertConfig(**small, max_position_embeddings=32))
    if kind == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2))
    if kind == "vit":
        return T.ViTForImageClassification(
            T.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=16, patch_size=8)
        )
    raise AssertionError(kind)


KINDS = ("llama", "mistral", "qwen2", "gpt2", "bert", "t5", "vit")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in (*KINDS, "gpt2-base"):
        _tiny(kind).save_pretrained(str(root / kind))
        out[kind] = root / kind
    return out


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of the folder ``src`` whose model.safetensors holds ``edit(state)`` (as a user re-saves it)."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    save_file(edit(state), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _truth(folder: Path) -> tuple[set[str], set[str], str]:
    """(unexpected keys, missing keys, class) as transformers' from_pretrained reports them, and the stored keys it
    drops without reporting them: those its class's ``_keys_to_ignore_on_load_unexpected`` patterns match (GPT-2's
    ``attn.bias`` also matches ``c_attn.bias``), which the table does not hold: the scan reports them."""
    import re

    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(str(folder), output_loading_info=True)
    unexpected = set(info["unexpected_keys"])
    ignored = "|".join(f"({p})" for p in model._keys_to_ignore_on_load_unexpected or ())
    if ignored:
        taken = {k for k in model.state_dict()}
        stored = load_file(str(folder / "model.safetensors"))
        # the ignored ones: stored, not reported, and matching a pattern (a renamed key loads under its new name)
        unexpected |= {k for k in stored if re.search(ignored, k) and k not in taken and not _loads(model, k)}
    return unexpected, set(info["missing_keys"]), arch


def _loads(model: Any, key: str) -> bool:
    """Whether the model takes the stored ``key`` once its base_model_prefix is added or stripped."""
    names = set(model.state_dict())
    prefix = model.base_model_prefix
    return f"{prefix}.{key}" in names or key.removeprefix(f"{prefix}.") in names


def _ours(folder: Path) -> hfload.LoadDtype:
    load = hfload.from_metadata(read_checkpoint(str(folder)).metadata)
    assert load is not None
    return load


def _tied(arch: str) -> set[str]:
    info = hftable.table().get(arch)
    assert not isinstance(info, str)
    return {hftable.template(n) for pair in info.tied.items() for n in pair}


def _assert_same_as_loader(folder: Path) -> hfload.LoadDtype:
    """The scan's unexpected names equal from_pretrained's; its missing names equal from_pretrained's as templates
    (a layer index as ``*``), but for tied weights: the table ties them whatever the config says, so a tied weight
    is missing for the scan only where none of its group is stored, and is then missing for the loader too."""
    unexpected, missing, arch = _truth(folder)
    load = _ours(folder)
    assert set(load.unexpected) == unexpected
    truth, tied = {hftable.template(m) for m in missing}, _tied(arch)
    assert set(load.missing) - tied == truth - tied
    assert set(load.missing) & tied <= truth
    return load


def _unmatched(folder: Path) -> list[Any]:
    return [f for f in check(read_checkpoint(str(folder))) if f.rule == "load-names-unmatched"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_folder_loads_every_name(saved: dict[str, Path], kind: str) -> None:
    load = _assert_same_as_loader(saved[kind])
    assert not load.unexpected and not load.missing and load.expected > 0
    assert _unmatched(saved[kind]) == []


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_ddp_prefix_loads_nothing_and_is_an_error(saved: dict[str, Path], tmp_path: Path, kind: str) -> None:
    folder = _rewrite(saved[kind], tmp_path / kind, lambda s: {f"module.{k}": v for k, v in s.items()})
    unexpected, missing, arch = _truth(folder)
    assert unexpected and len(unexpected) == len(load_file(str(folder / "model.safetensors")))  # nothing loaded
    _assert_same_as_loader(folder)
    (finding,) = _unmatched(folder)
    stored = len(unexpected)
    assert finding.severity == "error"
    assert f"from_pretrained loads 0 of the {stored} stored tensors into {arch}" in finding.message
    assert "`module.` prefix" in finding.message and "k.removeprefix('module.')" in finding.message
    done = run_cli("scan", str(folder), "-q")
    assert done.returncode == 1 and "load-names-unmatched" in done.stdout


def test_a_stray_tensor_is_one_warning(saved: dict[str, Path], tmp_path: Path) -> None:
    def stray(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**s, "extra_head.weight": torch.ones(4, 16), "optimizer.step": torch.zeros(1)}

    folder = _rewrite(saved["gpt2"], tmp_path / "gpt2", stray)
    unexpected, missing, _ = _truth(folder)
    assert unexpected == {"extra_head.weight", "optimizer.step"} and not missing
    _assert_same_as_loader(folder)
    (finding,) = _unmatched(folder)  # one row for one cause, not one per tensor
    assert finding.severity == "warning"
    assert finding.message.startswith("2 stored tensors match no name of GPT2LMHeadModel, so from_pretrained drops them")
    assert "extra_head.weight, optimizer.step" in finding.message


def test_a_stray_tensor_inside_a_loaded_module_is_no_warning(saved: dict[str, Path], tmp_path: Path) -> None:
    """A name inside a module the model loads may come from another config of the class (the table holds the
    default config's names): the scan names it in the metadata, as from_pretrained does, and warns of nothing."""
    folder = _rewrite(saved["gpt2"], tmp_path / "gpt2", lambda s: {**s, "transformer.h.0.attn.extra_scale": torch.ones(4)})
    load = _assert_same_as_loader(folder)
    assert load.variants == ("transformer.h.0.attn.extra_scale",)
    assert _unmatched(folder) == []


def _variant(kind: str) -> Any:
    import transformers as T

    torch.manual_seed(0)
    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    if kind == "llama-biases":
        return T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=1, attention_bias=True, mlp_bias=True))
    if kind == "gpt2-cross-attention":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, add_cross_attention=True))
    if kind == "t5-v1.1":  # flan-t5's gated feed-forward (wi_0, wi_1 where the default config has wi) and an untied head
        t5 = {"vocab_size": 64, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 2, "num_heads": 2}
        return T.T5ForConditionalGeneration(T.T5Config(**t5, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    if kind == "vit-no-qkv-bias":
        vit = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 24, "image_size": 16}
        return T.ViTForImageClassification(T.ViTConfig(**vit, patch_size=8, qkv_bias=False))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama-biases", "gpt2-cross-attention", "t5-v1.1", "vit-no-qkv-bias"])
def test_a_config_other_than_the_tables_default_is_no_finding(tmp_path: Path, kind: str) -> None:
    """Names a config option adds or removes (biases, cross-attention, a gated feed-forward) load under
    from_pretrained; the table has the default config's names, and the scan warns of nothing."""
    folder = tmp_path / kind
    _variant(kind).save_pretrained(str(folder))
    unexpected, missing, _ = _truth(folder)
    assert not unexpected and not missing
    load = _ours(folder)
    assert set(load.unexpected) | set(load.missing) == set(load.variants) != set()  # the table's default differs
    assert _unmatched(folder) == []


def test_a_missing_weight_and_a_few_prefixed_ones_are_warnings_by_cause(saved: dict[str, Path], tmp_path: Path) -> None:
    def edit(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = dict(s)
        del s["model.norm.weight"]
        s["module.model.layers.1.mlp.up_proj.weight"] = s.pop("model.layers.1.mlp.up_proj.weight")
        return s

    folder = _rewrite(saved["llama"], tmp_path / "llama", edit)
    unexpected, missing, _ = _truth(folder)
    assert missing == {"model.norm.weight", "model.layers.1.mlp.up_proj.weight"}
    load = _ours(folder)
    assert set(load.unexpected) == unexpected == {"module.model.layers.1.mlp.up_proj.weight"}
    # layer 1's up_proj is missing, but layer 0's fills its name with the layer index as *: the scan tells names apart,
    # not layers (the table's model has the default config's layer count)
    assert load.missing == ("model.norm.weight",)
    found = sorted(_unmatched(folder), key=lambda f: f.message)
    assert [f.severity for f in found] == ["warning", "warning"]
    assert found[0].message.startswith("1 of LlamaForCausalLM's 12 weight names")
    assert found[1].message.startswith("1 stored tensor carries a `module.` prefix LlamaForCausalLM does not expect")


def test_a_base_model_under_a_head_class_is_no_finding(saved: dict[str, Path], tmp_path: Path) -> None:
    """GPT2Model's keys (``h.0...``) load into GPT2LMHeadModel by its base_model_prefix; lm_head is tied to wte."""
    folder = tmp_path / "base"
    shutil.copytree(saved["gpt2-base"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    unexpected, missing, _ = _truth(folder)
    assert not unexpected and not missing
    load = _assert_same_as_loader(folder)
    assert not load.unexpected and not load.missing
    assert _unmatched(folder) == []


def test_another_models_weights_are_an_error(saved: dict[str, Path], tmp_path: Path) -> None:
    """bert's weights under a config naming GPT2LMHeadModel: nothing loads."""
    folder = tmp_path / "mixed"
    shutil.copytree(saved["gpt2"], folder)
    shutil.copy(saved["bert"] / "model.safetensors", folder / "model.safetensors")
    _assert_same_as_loader(folder)
    (finding,) = _unmatched(folder)
    assert finding.severity == "error" and "the stored names are not GPT2LMHeadModel's" in finding.message


def test_an_unknown_class_keeps_its_info(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    shutil.copytree(saved["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MyOwnForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    rules = {f.rule for f in check(read_checkpoint(str(folder)))}
    assert "load-names-unknown" in rules and "load-names-unmatched" not in rules


# -- item 7: noise ----------------------------------------------------------------------------------------------


def test_qwen2_max_window_layers_is_no_layer_count(saved: dict[str, Path]) -> None:
    """qwen2's config has max_window_layers 28 and the folder 2 layers: not a layer count, and no finding."""
    cfg = json.loads((saved["qwen2"] / "config.json").read_text())
    assert cfg["max_window_layers"] > cfg["num_hidden_layers"]
    done = run_cli("scan", str(saved["qwen2"]), "--fail-on", "info")
    assert done.returncode == 0 and "max_window_layers" not in done.stdout + done.stderr and "no findings" in done.stdout


def test_value_underflow_respects_a_share_of_values(tmp_path: Path) -> None:
    """A few values below float16's smallest subnormal, by chance in trained weights, are one info row and pass
    ``--fail-on warning``; a share above UNDERFLOW_WARN_FRACTION is a warning, above the block share an error.
    Counted against torch's own cast to float16."""
    from dtypeaudit.values import UNDERFLOW_BLOCK_FRACTION, UNDERFLOW_WARN_FRACTION

    torch.manual_seed(0)
    n = 10_000
    state = {f"few.{i}.weight": torch.randn(n) for i in range(6)}
    for t in state.values():
        t[:3] = 1e-9  # 0.03% of the values
    state["some.weight"] = torch.randn(n)
    state["some.weight"][:50] = 1e-9  # 0.5%
    state["many.weight"] = torch.randn(n)
    state["many.weight"][:500] = 1e-9  # 5%
    for t in state.values():  # the shares as torch's cast gives them
        share = float(((t.half() == 0) & (t != 0)).sum()) / float((t != 0).sum())
        assert share > 0
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))

    found = [f for f in _value_findings(path) if f.rule == "fp16-underflow"]
    by = {f.tensor: f.severity for f in found}
    assert by == {**{f"few.{i}.weight": "info" for i in range(6)}, "some.weight": "warning", "many.weight": "error"}
    assert len({f.message for f in found if f.severity == "info"}) == 1  # one cause, one message: one row
    messages = {f.severity: f.message for f in found}
    assert messages["info"].startswith(f"at most {UNDERFLOW_WARN_FRACTION:.1%} of the non-zero values")
    assert messages["warning"].startswith(f"more than {UNDERFLOW_WARN_FRACTION:.1%} (at most {UNDERFLOW_BLOCK_FRACTION:.0%})")
    done = run_cli("scan", str(path), "--values", "--fail-on", "warning")
    assert done.returncode == 1 and "fp16-underflow ×6" in done.stdout
    state = {k: v for k, v in state.items() if k.startswith("few.")}
    save_file(state, str(path))
    done = run_cli("scan", str(path), "--values", "--fail-on", "warning")
    assert done.returncode == 0, done.stdout  # 0.03% of the values: nothing fails a warning gate


def _value_findings(path: Path) -> list[Any]:
    from dtypeaudit.conversion.value_policy import value_findings

    return value_findings(read_checkpoint(str(path)))


def test_a_serving_preset_on_an_unquantized_model_says_no_quantized_weights(saved: dict[str, Path], tmp_path: Path) -> None:
    """fp8-serving on a plain model is an error saying so; on a quantized checkpoint of any scheme it is not (a GPTQ
    one fails by the preset's scheme rules instead, which say what is wrong)."""
    from tests.test_quant_scan import fp8_state, gptq_tensors, write_dir

    def rules_of(path: Path, *policy: str) -> tuple[int, list[str]]:
        done = run_cli("scan", str(path), *policy, "-f", "json")
        return done.returncode, [f["rule"] for c in json.loads(done.stdout)["checkpoints"] for f in c["findings"]]

    bf16 = tmp_path / "bf16"
    _tiny("llama").to(torch.bfloat16).save_pretrained(str(bf16))
    for plain in (saved["llama"], bf16):  # float32 and bfloat16
        code, found = rules_of(plain, "--preset", "fp8-serving")
        assert code == 1 and found == ["no-quantized-weights"]
        assert rules_of(plain) == (0, [])
    finding = next(f for f in check(read_checkpoint(str(bf16)), load_policy("fp8-serving")) if f.rule == "no-quantized-weights")
    assert finding.severity == "error" and finding.message.startswith("no quantized weights: every tensor is stored unquantized (bfloat16)")

    state, config = fp8_state()
    fp8 = write_dir(tmp_path / "fp8", state, config)
    assert rules_of(fp8, "--preset", "fp8-serving") == (0, [])
    cfg = {"torch_dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}}
    gptq = write_dir(tmp_path / "gptq", gptq_tensors(512, 512), cfg)
    code, found = rules_of(gptq, "--preset", "fp8-serving")
    assert code == 1 and "no-quantized-weights" not in found and "dtype-mismatch" in found

    own = tmp_path / "mine.yaml"  # a policy extending the preset inherits it; one that says false drops it
    own.write_text("version: 1\nextends: fp8-serving\n")
    assert rules_of(bf16, "--policy", str(own))[1] == ["no-quantized-weights"]
    own.write_text("version: 1\nextends: fp8-serving\nrequires_quantized: false\n")
    assert rules_of(bf16, "--policy", str(own)) == (0, [])


def test_bitsandbytes_findings_of_one_cause_are_one_row(tmp_path: Path) -> None:
    """Seven nf4 Linear4bit layers (bitsandbytes' own Params4bit) whose absmax was stored in float16, as a
    state dict cast to half leaves them: seven quant-scale-dtype findings of one cause, one row in the text table
    and in the grouped formats."""
    bnb = pytest.importorskip("bitsandbytes")
    from tests.test_quant_scan import write_dir

    torch.manual_seed(0)
    state = {}
    for i in range(7):
        layer = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compress_statistics=False)
        layer.weight = bnb.nn.Params4bit(
            torch.randn(64, 128), requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
        ).to("cpu")
        for k, v in layer.state_dict().items():
            state[f"model.layers.{i}.fc.{k}"] = v.half() if k.endswith(".absmax") else v
    config = {
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    }
    path = write_dir(tmp_path / "nf4", state, config)
    found = [f for f in check(read_checkpoint(str(path))) if f.rule == "quant-scale-dtype"]
    assert len(found) == 7 and len({f.message for f in found}) == 1
    assert {f.tensor for f in found} == {f"model.layers.{i}.fc.weight.absmax" for i in range(7)}
    assert found[0].message.startswith("is float16; bitsandbytes' Linear4bit expects float32 for the absmax of nf4")
    table = run_cli("scan", str(path), "-q").stdout
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("warning")] == [["warning", "quant-scale-dtype"]]
    assert "quant-scale-dtype ×7" in table
    markdown = run_cli("scan", str(path), "-f", "markdown").stdout
    assert sum("quant-scale-dtype" in line for line in markdown.splitlines()) == 1


def test_gpt2s_legacy_attention_buffers_are_no_finding(saved: dict[str, Path], tmp_path: Path) -> None:
    """The hub's GPT-2 stores the causal-mask buffers older transformers saved (``h.N.attn.bias``): from_pretrained
    drops them without a word (its class ignores them), and so does the scan: they lie inside a module the
    checkpoint loads."""

    def legacy(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(s)
        for i in range(2):
            out[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        return out

    folder = _rewrite(saved["gpt2"], tmp_path / "gpt2", legacy)
    import transformers

    _, info = transformers.GPT2LMHeadModel.from_pretrained(str(folder), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    load = _ours(folder)
    assert len(load.unexpected) == 2 and set(load.unexpected) == set(load.variants)
    assert _unmatched(folder) == []


def test_a_weight_converter_across_layers_is_one_finding_per_target(tmp_path: Path) -> None:
    """Qwen2-MoE's experts, fused on load into one tensor per layer: one load-conversion-unmodelled per target
    across the layers (a 48-layer MoE is one cause, not 96 rows), naming what from_pretrained really builds."""
    import transformers as T

    torch.manual_seed(0)
    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    cfg = T.Qwen2MoeConfig(**small, num_key_value_heads=1, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    folder = tmp_path / "moe"
    T.Qwen2MoeForCausalLM(cfg).save_pretrained(str(folder))
    real = set(T.Qwen2MoeForCausalLM.from_pretrained(str(folder)).state_dict())
    assert {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")} <= real
    found = sorted((f for f in check(read_checkpoint(str(folder))) if f.rule == "load-conversion-unmodelled"), key=lambda f: f.message)
    assert [f.tensor for f in found] == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    assert found[0].message.startswith("from_pretrained builds model.layers.*.mlp.experts.down_proj (2 of them) from 8 stored")
    assert found[1].message.startswith("from_pretrained builds model.layers.*.mlp.experts.gate_up_proj (2 of them) from 16 stored")
