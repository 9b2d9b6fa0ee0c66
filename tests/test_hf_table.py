"""The table of what from_pretrained needs from transformers (dtypeaudit/data/transformers.json): equal to the
installed transformers, and its pure-Python renamer equal to transformers' own ``rename_source_key``."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dtypeaudit.formats import hftable

from .helpers import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

# Common classes, and one of each kind of transform: converters (Mixtral, Qwen2-MoE, DeepSeek-V2's experts),
# sub-models scoped (BLIP-2, LLaVA, CLIP), weight-norm renames (Wav2Vec2), the ViT renames, and the renamings
# with code of their own that the table names by kind.
SAMPLE = [
    "LlamaForCausalLM",
    "LlamaModel",
    "GPT2LMHeadModel",
    "T5ForConditionalGeneration",
    "BertForMaskedLM",
    "BertModel",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "ViTForImageClassification",
    "DeepseekV2ForCausalLM",
    "WhisperForConditionalGeneration",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "CLIPModel",
    "Blip2ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "RobertaForSequenceClassification",
    "BartForConditionalGeneration",
    "Wav2Vec2ForCTC",
    "DistilBertModel",
    "DoryForCausalLM",  # LayerPairCollapse
    "Inkling2ForCausalLM",  # an index offset
    "Kimi_K25ForConditionalGeneration",  # GroupWeightRename
]


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    """scripts/generate_transformers_table.py, the generator the table came from."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)  # by name, so the generator's worker processes import it too
    return importlib.import_module("generate_transformers_table")


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return json.loads(hftable.TABLE.read_text())


def test_the_table_names_the_installed_transformers(doc: dict[str, Any]) -> None:
    import transformers

    assert doc["transformers_version"] == transformers.__version__, "run scripts/generate_transformers_table.py"
    assert doc["generated_by"] == "scripts/generate_transformers_table.py"
    assert hftable.table().transformers_version == transformers.__version__
    assert set(SAMPLE) <= set(doc["classes"])


@pytest.mark.parametrize("name", SAMPLE)
def test_a_class_equals_the_installed_transformers(gen: ModuleType, doc: dict[str, Any], name: str) -> None:
    assert gen.expanded(doc, name) == gen.without_empty(gen.entry(name))


@pytest.mark.slow  # builds every class transformers has (minutes)
def test_every_class_equals_the_installed_transformers(gen: ModuleType, doc: dict[str, Any]) -> None:
    raw = gen.entries(gen.candidates(), jobs=2)
    assert sorted(raw) == sorted(doc["classes"])
    differ = [n for n, e in raw.items() if gen.expanded(doc, n) != gen.without_empty(e)]
    assert not differ, differ[:20]


def _theirs(name: str) -> tuple[Any, list[Any], dict[str, Any]]:
    """The class built as the table's generator builds it, its conversion mapping and its state dict."""
    import torch
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping

    cls = getattr(transformers, name)
    with torch.device("meta"):
        model = cls._from_config(cls.config_class(), dtype=torch.float16)
    return model, get_model_conversion_mapping(model), model.state_dict()


def _checkpoint_names(name: str) -> list[str]:
    """Names a checkpoint of the class may hold: the model's own, as save_pretrained writes them (the mapping
    reversed), with the base model prefix added and stripped, and MoE experts stored one per expert."""
    from transformers.core_model_loading import WeightConverter, rename_source_key

    model, mapping, state = _theirs(name)
    prefix = model.base_model_prefix
    names = set(state)
    reverse = []
    for t in mapping:
        try:
            reverse.append(t.reverse_transform())
        except Exception:  # a converter without a reverse op: its stored names come from the experts below
            pass
    for key in state:
        saved, _ = rename_source_key(
            key,
            [t for t in reverse if not isinstance(t, WeightConverter)],
            [t for t in reverse if isinstance(t, WeightConverter)],
            reverse=True,
        )
        names.add(saved)
    for key in list(names):
        if prefix:
            names.add(f"{prefix}.{key}")
            names.add(key.removeprefix(f"{prefix}."))
        found = re.match(r"(.*\.layers\.\d+)\.mlp\.experts\.", key)
        if found:  # a layer with experts (a MoE's first layers may be dense: the table does not tell layers apart)
            for stored in (".block_sparse_moe.experts.0.w1.weight", ".mlp.experts.1.gate_proj.weight", ".mlp.experts.0.down_proj.weight"):
                names.add(found.group(1) + stored)
    names.add("module.lm_head.weight")  # another model's names: matched by nothing
    return sorted(n for n in names if "*" not in n)


@pytest.mark.parametrize("name", SAMPLE)
def test_the_renamer_equals_transformers_rename_source_key(name: str) -> None:
    from transformers.core_model_loading import WeightConverter, rename_source_key

    names = _checkpoint_names(name)
    model, mapping, state = _theirs(name)
    info = hftable.table().get(name)
    assert isinstance(info, hftable.ClassInfo), info
    transforms = info.transforms()
    ours_ren = [t for t in transforms if t.kind != "convert"]
    ours_conv = [t for t in transforms if t.kind == "convert"]
    their_ren = [m for m in mapping if not isinstance(m, WeightConverter)]
    their_conv = [m for m in mapping if isinstance(m, WeightConverter)]
    for key in names:  # in sorted order, as the loader renames them (a group renaming keeps state)
        theirs = rename_source_key(key, their_ren, their_conv, model.base_model_prefix, state)
        assert hftable.rename_source_key(key, ours_ren, ours_conv, info) == theirs, key


@pytest.mark.parametrize("name", SAMPLE)
def test_loaded_names_equal_the_loaders(name: str) -> None:
    """``hftable.rename`` against the loader's own steps run with transformers: rename, retry with the prefix alone
    where only the stored name is a model key, drop keys the model lacks."""
    from transformers.core_model_loading import WeightConverter, rename_source_key

    names = _checkpoint_names(name)
    model, mapping, state = _theirs(name)
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    renamed, converted = {}, {}
    for key in names:
        new, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if new not in state and key in state:
            new, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=state)
        if new not in state:
            continue
        if pattern is not None:
            conv = next(c for c in converters if pattern in c.source_patterns)
            converted[key] = (new, tuple(type(op).__name__ for op in conv.operations))
        elif new != key:
            renamed[key] = new
    info = hftable.table().get(name)
    assert isinstance(info, hftable.ClassInfo)
    ours = hftable.rename(info, names)
    assert ours.renamed == renamed
    assert ours.converted == converted


def test_an_architecture_the_table_lacks_says_so_with_the_version() -> None:
    from dtypeaudit.formats import hfload

    view = hfload.model_view({"architectures": ["NotAModelForCausalLM"]}, "float16", ["w"])
    assert view == f"the table of transformers {hftable.table().transformers_version}'s classes has no NotAModelForCausalLM"


def test_a_class_whose_default_config_does_not_build_keeps_its_own_lists_and_says_why(tmp_path: Path) -> None:
    """AutoformerForPrediction refuses its own defaults (no prediction_length): the table records the error; a
    folder naming it is judged with the class's own keep lists and a note that its names are not known."""
    import transformers

    from dtypeaudit.checks import check
    from dtypeaudit.formats import read_checkpoint

    info = hftable.table().get("AutoformerForPrediction")
    assert isinstance(info, str) and "cannot build AutoformerForPrediction from its default config" in info
    assert "prediction_length" in info and transformers.__version__ in info
    import numpy as np
    from safetensors.numpy import save_file

    d = tmp_path / "m"
    d.mkdir()
    save_file({"model.encoder.w": np.zeros(2, np.float16)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"architectures": ["AutoformerForPrediction"], "dtype": "float16"}))
    inv = read_checkpoint(d)
    meta = inv.metadata["from_pretrained_dtype"]
    assert meta["keep_in_fp32_modules"] == list(transformers.AutoformerForPrediction._keep_in_fp32_modules or ())  # type: ignore[index]
    found = {f.rule: f for f in check(inv)}
    assert "cannot build AutoformerForPrediction" in found["load-names-unknown"].message


def test_the_table_is_small(doc: dict[str, Any]) -> None:
    """Shared names and transforms keep the shipped file small for some two thousand classes."""
    assert len(doc["classes"]) > 1000
    assert hftable.TABLE.stat().st_size < 4_000_000


def test_the_table_is_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dtypeaudit"]
    assert "data/*.json" in data and hftable.TABLE.relative_to(ROOT / "dtypeaudit") == Path("data/transformers.json")
