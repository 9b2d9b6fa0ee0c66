"""The model transformers 5 builds from a folder: keys renamed between disk and model (the conversion mapping),
WeightConverters that merge tensors (refused with a finding), and the keep-in-fp32 lists of sub-models.

Every folder is written by ``save_pretrained`` and compared with what ``from_pretrained(folder)`` (default
arguments) really builds: its ``state_dict()`` names and dtypes."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from dtypeaudit.checks import as_policies_see_it, check
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import Inventory
from dtypeaudit.policy import load_policy
from tests.helpers import run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


VIT = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "image_size": 16,
    "patch_size": 8,
    "num_labels": 3,
}


def _vit_model() -> Any:
    import transformers

    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**VIT))


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT saved in float16: on disk ``vit.encoder.layer.*``, in the model ``vit.layers.*``."""
    d = tmp_path_factory.mktemp("vit") / "vit"
    _vit_model().half().save_pretrained(str(d))
    return d


def _stored(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _real(path: Path) -> dict[str, str]:
    """Name -> dtype of the model from_pretrained(folder) builds, with the class config.json names."""
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(path))
    return {k: str(v.dtype).removeprefix("torch.") for k, v in model.state_dict().items()}


def _ours(inv: Inventory) -> dict[str, str]:
    """Name -> dtype of each stored tensor as the policy sees it: under its loaded name, in its loaded dtype."""
    return {t.name: t.dtype for t in as_policies_see_it(inv)}


def test_vit_keys_load_under_the_models_names(vit_dir: Path) -> None:
    stored, real = _stored(vit_dir), _real(vit_dir)
    assert "vit.encoder.layer.0.attention.attention.key.weight" in stored  # save_pretrained writes the old names
    assert "vit.layers.0.attention.k_proj.weight" in real and not stored & {k for k in real if ".layers." in k}
    inv = read_checkpoint(vit_dir)
    assert _ours(inv) == real  # every name and dtype as the loaded model has it
    renamed = inv.metadata["from_pretrained_dtype"]["renamed"]  # type: ignore[index]
    assert renamed["vit.encoder.layer.0.attention.attention.key.weight"] == "vit.layers.0.attention.k_proj.weight"
    assert set(renamed) == stored - set(real)
    found = {f.rule: f for f in check(inv)}
    assert "load-renamed" in found and found["load-renamed"].severity == "info"
    assert f"{len(renamed)} tensors load under another name" in found["load-renamed"].message
    assert "vit.encoder.layer.0.attention.attention.key.bias -> vit.layers.0.attention.k_proj.bias" in found["load-renamed"].message
    assert "load-names-unknown" not in found and "load-conversion-unmodelled" not in found


def test_the_policy_judges_the_loaded_names_and_shows_the_stored_ones(vit_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: float16\nrules:\n"
        "  - name: q-fp32\n    match: ['vit.layers.*.attention.q_proj.weight']\n    dtype: float32\n"
        "  - name: old-names-bf16\n    match: ['vit.encoder.layer.*']\n    dtype: bfloat16\n"
    )
    found = [f for f in check(read_checkpoint(vit_dir), load_policy(str(policy))) if f.rule == "dtype-mismatch"]
    # the rule on the loaded names applies; the one on the stored names matches nothing the model holds
    assert sorted(f.tensor or "" for f in found) == ["vit.layers.0.attention.q_proj.weight", "vit.layers.1.attention.q_proj.weight"]
    # one message for the lot, so the report folds them; the stored names are in the metadata
    assert len({f.message for f in found}) == 1 and "vit.encoder" not in found[0].message
    result = run_cli("scan", str(vit_dir), "--policy", str(policy), "--format", "json")
    doc = json.loads(result.stdout)
    assert result.returncode == 1
    meta = doc["checkpoints"][0]["metadata"]["from_pretrained_dtype"]
    assert meta["renamed"]["vit.encoder.layer.1.output.dense.weight"] == "vit.layers.1.mlp.fc2.weight"
    assert {t["name"] for t in doc["checkpoints"][0]["tensors"]} == _stored(vit_dir)  # the tensors listed as stored


def test_scan_model_on_the_saving_class_matches(vit_dir: Path, tmp_path: Path) -> None:
    factory = tmp_path / "make_vit.py"
    factory.write_text(
        f"import transformers\n\n\ndef make():\n    return transformers.ViTForImageClassification(transformers.ViTConfig(**{VIT!r}))\n"
    )
    for model in (str(vit_dir), f"{factory}:make"):
        result = run_cli("scan", str(vit_dir), "--model", model, "--format", "json")
        doc = json.loads(result.stdout)
        rules = {f["rule"] for f in doc["checkpoints"][0]["findings"]}
        assert result.returncode == 0, (model, result.stdout[-2000:], result.stderr)
        assert "model-mismatch" not in rules
        kinds = {t["name"]: t["module"] for t in doc["checkpoints"][0]["tensors"]}
        assert kinds["vit.encoder.layer.0.layernorm_before.weight"] == "LayerNorm"  # matched through its loaded name
        assert kinds["vit.encoder.layer.0.attention.attention.key.weight"] == "Linear"


def test_trace_on_the_saving_class(vit_dir: Path) -> None:
    from dtypeaudit.trace import trace

    report = trace(str(vit_dir), inputs=["pixel_values=1x3x16x16"])
    c = report.checkpoints[0]
    assert c.trace is not None and c.trace.checkpoint == str(vit_dir)
    assert not [f for f in c.findings if f.rule == "checkpoint-missing"]
    assert {t.dtype for t in c.tensors if t.name.startswith("vit.layers.")} == {"float16"}


def test_a_class_transformers_lacks_leaves_the_names_unknown(vit_dir: Path, tmp_path: Path) -> None:
    import transformers

    d = tmp_path / "custom"
    shutil.copytree(vit_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MyOwnViTForImageClassification"]  # a class of the user's code: never imported
    (d / "config.json").write_text(json.dumps(cfg))
    inv = read_checkpoint(d)
    found = {f.rule: f for f in check(inv)}
    assert "load-names-unknown" in found and "load-renamed" not in found
    version = transformers.__version__
    assert f"the table of transformers {version}'s classes has no MyOwnViTForImageClassification" in found["load-names-unknown"].message
    assert set(_ours(inv)) == _stored(d)  # judged under the stored names
    assert inv.metadata["from_pretrained_dtype"]["names_unknown"]  # type: ignore[index]


def test_a_config_asking_for_more_layers_than_the_folder_stores_is_read_from_the_table(vit_dir: Path, tmp_path: Path) -> None:
    """Nothing is built: ten million layers cost a scan no more than two (from_pretrained would build them all)."""
    d = tmp_path / "huge"
    shutil.copytree(vit_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**7
    (d / "config.json").write_text(json.dumps(cfg))
    inv = read_checkpoint(d)
    found = {f.rule: f for f in check(inv)}
    assert "load-names-unknown" not in found and "load-renamed" in found
    assert _ours(inv) == _ours(read_checkpoint(vit_dir))


def test_merged_moe_experts_are_refused_with_a_finding(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=16,
    )
    d = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(cfg).half().save_pretrained(str(d))
    stored, real = _stored(d), _real(d)
    experts = {n for n in stored if ".experts." in n}
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in experts  # on disk one tensor per expert, another module name
    assert "model.layers.0.mlp.experts.gate_up_proj" in real and not experts & set(real)  # in the model, fused
    inv = read_checkpoint(d)
    found = [f for f in check(inv) if f.rule == "load-conversion-unmodelled"]
    assert {f.tensor for f in found} == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert all(f.severity == "warning" for f in found)
    gate_up = next(f for f in found if f.tensor and f.tensor.endswith("gate_up_proj"))
    assert "from 4 stored tensors" in gate_up.message and "MergeModulelist, Concatenate" in gate_up.message
    ours = _ours(inv)
    assert experts <= set(ours)  # the merged ones keep their stored names
    rest = {n: d for n, d in ours.items() if n not in experts}
    assert rest == {n: real[n] for n in rest}  # every other tensor: the loaded model's name and dtype


def test_keep_in_fp32_lists_of_sub_models_apply(tmp_path: Path) -> None:
    """BLIP-2 with a T5 language model: the top class keeps query_tokens and the Q-Former in fp32, and its
    T5ForConditionalGeneration child adds ``wo``, which ``post_init`` gathers into the top model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Blip2Config(
        vision_config={
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
        qformer_config={
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "encoder_hidden_size": 8,
            "vocab_size": 16,
            "max_position_embeddings": 8,
        },
        text_config={
            "model_type": "t5",
            "vocab_size": 16,
            "d_model": 8,
            "d_kv": 4,
            "d_ff": 16,
            "num_layers": 1,
            "num_heads": 2,
            "decoder_start_token_id": 0,
        },
        num_query_tokens=2,
    )
    assert "wo" not in (transformers.Blip2ForConditionalGeneration._keep_in_fp32_modules or [])  # only the child's list has it
    d = tmp_path / "blip2"
    transformers.Blip2ForConditionalGeneration(cfg).half().save_pretrained(str(d))
    real = _real(d)
    inv = read_checkpoint(d)
    ours = _ours(inv)
    assert ours == {n: real[n] for n in ours}
    assert set(real) - set(ours) == {  # tied to the shared embedding, not stored
        "language_model.decoder.embed_tokens.weight",
        "language_model.encoder.embed_tokens.weight",
        "language_model.lm_head.weight",
    }
    wo = {n for n in ours if ".wo." in n}
    assert wo and {ours[n] for n in wo} == {"float32"} and {t.dtype for t in inv.tensors if t.name in wo} == {"float16"}
    assert "wo" in inv.metadata["from_pretrained_dtype"]["keep_in_fp32_modules"]  # type: ignore[index]


def test_explain_finds_a_tensor_by_its_stored_or_loaded_name(vit_dir: Path) -> None:
    for name in ("vit.encoder.layer.0.attention.attention.key.weight", "vit.layers.0.attention.k_proj.weight"):
        result = run_cli("scan", str(vit_dir), "--preset", "fp16", "--explain", name)
        assert result.returncode == 0, result.stderr
        assert "vit.layers.0.attention.k_proj.weight" in result.stdout


def test_convert_plans_on_the_loaded_names(tmp_path: Path) -> None:
    """A rule on loaded names holds the stored tensors it names when convert plans; from_pretrained then casts the
    whole model to the config's one dtype, so the planned output fails that rule and nothing is written."""
    from dtypeaudit.conversion import convert

    src = tmp_path / "vit32"
    _vit_model().save_pretrained(str(src))  # float32
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: float16\nrules:\n  - name: q-fp32\n    match: ['vit.layers.*.attention.q_proj.weight']\n    dtype: float32\n"
    )
    result = convert(src, "fp16", output=tmp_path / "vit16", policy=load_policy(str(policy)))
    kept = {p.tensor.name for p in result.plan.tensors if p.target == "float32"}
    assert kept == {f"vit.encoder.layer.{i}.attention.attention.query.weight" for i in (0, 1)}
    assert result.output is None and not (tmp_path / "vit16").exists()
    assert sorted(f.tensor or "" for f in result.failed if f.rule == "dtype-mismatch") == [
        "vit.layers.0.attention.q_proj.weight",
        "vit.layers.1.attention.q_proj.weight",
    ]


_VISION = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 24, "image_size": 16, "patch_size": 8}
_TEXT = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 16,
}
_SWEEP: dict[str, tuple[str, dict[str, Any]]] = {
    "DeiTForImageClassification": ("DeiTConfig", _VISION),
    "BeitForImageClassification": ("BeitConfig", _VISION),
    "Dinov2Model": ("Dinov2Config", _VISION),
    "ViTMAEModel": ("ViTMAEConfig", _VISION),
    "CLIPModel": ("CLIPConfig", {"text_config": _TEXT, "vision_config": _VISION, "projection_dim": 8}),
    "SiglipModel": ("SiglipConfig", {"text_config": _TEXT, "vision_config": _VISION}),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        {**_TEXT, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
    ),
    "LlamaForCausalLM": ("LlamaConfig", {**_TEXT, "num_key_value_heads": 1}),
    "BertForMaskedLM": ("BertConfig", _TEXT),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(_SWEEP))
def test_loaded_names_and_dtypes_agree_with_from_pretrained(arch: str, tmp_path: Path) -> None:
    """A sweep of classes with and without a conversion mapping, saved in float16: every stored tensor that is
    not merged by a WeightConverter has the loaded model's name and dtype."""
    import transformers

    config_class, kwargs = _SWEEP[arch]
    torch.manual_seed(0)
    d = tmp_path / "m"
    getattr(transformers, arch)(getattr(transformers, config_class)(**kwargs)).half().save_pretrained(str(d))
    real = _real(d)
    inv = read_checkpoint(d)
    meta = inv.metadata["from_pretrained_dtype"]
    assert meta["names_unknown"] is None  # type: ignore[index]
    converted = set(meta["converted"])  # type: ignore[index]
    ours = {n: dt for n, dt in _ours(inv).items() if n not in converted}
    assert ours == {n: real[n] for n in ours}
