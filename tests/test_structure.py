"""The module structure a state dict implies: guesses from names and shapes, facts from --model."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from dtypeaudit import structure
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import Inventory, TensorRecord
from dtypeaudit.structure import Module, annotate, by_tensor, dominant_dtype, infer_modules, modules_of, strip_wrappers

from .helpers import inventory_of
from .models import MODELS, TinyCNN, TinyLM


def rec(name: str, shape: tuple[int, ...], dtype: str = "float32", **kw: object) -> TensorRecord:
    return TensorRecord(name, dtype, shape, 4, **kw)  # type: ignore[arg-type]


def modules(*records: TensorRecord) -> dict[str, Module]:
    return {m.prefix: m for m in infer_modules(Inventory("x", "test", records))}


REAL_MODELS: dict[str, Callable[[], nn.Module]] = {**MODELS, "tiny_cnn": TinyCNN, "tiny_lm": TinyLM}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_guesses_agree_with_the_real_module_types(name: str) -> None:
    """On real models, the kind guessed from names and shapes is the kind of the module type torch reports."""
    model = REAL_MODELS[name]()
    facts = {m.prefix: m for m in infer_modules(inventory_of(model, facts=True))}
    guesses = {m.prefix: m for m in infer_modules(inventory_of(model, facts=False))}
    assert facts.keys() == guesses.keys()
    real = {n: type(m).__name__ for n, m in model.named_modules()}
    for prefix, fact in facts.items():
        guess = guesses[prefix]
        assert fact.type_name == real[prefix] and guess.type_name is None
        assert guess.confidence in ("high", "low")
        if fact.confidence == "fact":
            assert guess.kind == fact.kind, (prefix, fact, guess)
        # What a forward pass needs to know is never guessed low for BatchNorm, Conv, biased Linear or LayerNorm.
        if fact.kind in ("batchnorm", "conv") or (fact.kind in ("linear", "norm") and fact.leaf("bias") is not None):
            assert guess.confidence == "high", prefix


def test_batchnorm_inside_sequentials_is_found_wherever_it_sits() -> None:
    """torchvision's pattern: BatchNorms as ``layer1.1``, ``downsample.1``; the step counter is no floating tensor."""
    bn = ("weight", "bias", "running_mean", "running_var")
    found = modules(
        *(rec(f"layer1.1.{leaf}", (8,), "float16") for leaf in bn),
        rec("layer1.1.num_batches_tracked", (), "int64"),
        *(rec(f"layer2.0.downsample.1.{leaf}", (16,)) for leaf in bn),
        rec("layer2.0.downsample.0.weight", (16, 8, 1, 1)),
    )
    assert (found["layer1.1"].kind, found["layer1.1"].confidence) == ("batchnorm", "high")
    assert found["layer2.0.downsample.1"].kind == "batchnorm"
    assert found["layer2.0.downsample.0"].kind == "conv"
    assert len(found["layer1.1"].tensors) == 5
    assert found["layer1.1"].floating_dtypes == {"float16"} and found["layer1.1"].dtype == "float16"
    # Running statistics alone (affine=False) are still a BatchNorm.
    assert modules(rec("bn.running_mean", (4,)), rec("bn.running_var", (4,)))["bn"].kind == "batchnorm"


@pytest.mark.parametrize(
    ("records", "kind", "confidence", "guessed"),
    [
        ((rec("fc.weight", (4, 8)), rec("fc.bias", (4,))), "linear", "high", "Linear"),
        ((rec("c_attn.weight", (32, 96)), rec("c_attn.bias", (96,))), "linear", "high", "Linear"),  # transformers' Conv1D
        ((rec("fc.weight", (4, 8)), rec("fc.bias", (5,))), "linear", "low", None),
        ((rec("conv.weight", (8, 3, 3, 3)),), "conv", "high", "Conv2d"),
        ((rec("conv.weight", (8, 3, 3)), rec("conv.bias", (8,))), "conv", "high", "Conv1d"),
        ((rec("wte.weight", (64, 16)),), "embedding", "high", "Embedding"),
        ((rec("embed_tokens.weight", (64, 16)),), "embedding", "high", "Embedding"),
        ((rec("table.weight", (64, 16)),), "embedding", "low", None),
        ((rec("lm_head.weight", (64, 16)),), "linear", "low", None),
        ((rec("ln.weight", (16,)), rec("ln.bias", (16,))), "norm", "high", "LayerNorm"),
        # A lone 1-D weight under a norm's name is a weight-only (RMS-style) norm: Llama, Meta's, GPT-NeoX's names.
        ((rec("model.layers.0.input_layernorm.weight", (16,)),), "norm", "high", "RMSNorm"),
        ((rec("model.norm.weight", (16,)),), "norm", "high", "RMSNorm"),
        ((rec("layers.0.attention_norm.weight", (16,)),), "norm", "high", "RMSNorm"),
        ((rec("ln_f.weight", (16,)),), "norm", "high", "RMSNorm"),
        ((rec("scale.weight", (16,)),), "norm", "low", None),
        ((rec("attn.in_proj_weight", (48, 16)), rec("attn.in_proj_bias", (48,))), "unknown", "low", None),
        ((rec("w.weight", (2, 2, 2, 2, 2, 2)),), "unknown", "low", None),
        ((rec("fc.weight", (4, 8)), rec("fc.bias", (4,)), rec("fc.scale", (4,))), "linear", "low", None),
        ((rec("bn.running_mean", (4,)), rec("bn.running_var", (4,))), "batchnorm", "high", "BatchNorm"),
    ],
)
def test_kind_from_names_and_shapes(records: tuple[TensorRecord, ...], kind: str, confidence: str, guessed: str | None) -> None:
    (m,) = modules(*records).values()
    assert (m.kind, m.confidence, m.type_name, m.guessed_type) == (kind, confidence, None, guessed)


def test_module_types_from_the_model_are_facts() -> None:
    found = modules(
        rec("h.0.ln.weight", (8,), module="LayerNorm"),
        rec("h.0.ln.bias", (8,), module="LayerNorm"),
        rec("h.0.norm.weight", (8,), module="LlamaRMSNorm"),
        rec("h.0.c_fc.weight", (8, 32), module="Conv1D"),
        rec("h.0.c_fc.bias", (32,), module="Conv1D"),
        rec("h.0.odd.weight", (8, 8), module="MyProjection"),
        rec("h.0.inorm.weight", (8,), module="InstanceNorm2d"),
        rec("h.0.inorm.bias", (8,), module="InstanceNorm2d"),
        rec("h.0.inorm.running_mean", (8,), module="InstanceNorm2d"),
    )
    assert (found["h.0.ln"].kind, found["h.0.ln"].confidence, found["h.0.ln"].type_name) == ("norm", "fact", "LayerNorm")
    assert (found["h.0.c_fc"].kind, found["h.0.c_fc"].confidence) == ("linear", "fact")
    # A type PyTorch's kernels say nothing about keeps its name, but its kind is a guess.
    assert (found["h.0.norm"].kind, found["h.0.norm"].confidence, found["h.0.norm"].type_name) == ("norm", "high", "LlamaRMSNorm")
    assert (found["h.0.odd"].kind, found["h.0.odd"].confidence) == ("embedding", "low")
    assert found["h.0.odd"].label == "MyProjection, Embedding-like" and "not known" in found["h.0.odd"].provenance
    assert (found["h.0.inorm"].kind, found["h.0.inorm"].confidence) == ("norm", "fact")  # statistics of any dtype
    assert found["h.0.ln"].label == "LayerNorm" and found["h.0.ln"].provenance == "module type from the model"
    # A type that is not PyTorch's own also gets the type its shape suggests, for policies' module: selectors.
    assert found["h.0.norm"].guessed_type == "RMSNorm" and found["h.0.ln"].guessed_type is None
    assert found["h.0.c_fc"].guessed_type is None and found["h.0.odd"].guessed_type is None  # a low guess names nothing


def test_annotate_fills_guesses_that_are_never_taken_for_facts() -> None:
    inv = Inventory(
        "x",
        "test",
        (
            rec("model.layers.0.input_layernorm.weight", (8,)),
            rec("model.layers.0.mlp.up.weight", (16, 8)),
            rec("model.layers.0.mlp.up.bias", (16,)),
            rec("h.ln.weight", (8,), module="LayerNorm"),
            rec("h.ln.bias", (8,), module="LayerNorm"),
            rec("h.t5.weight", (8,), module="T5LayerNorm"),
            rec("table.weight", (64, 16)),
            rec("state.0.exp_avg", (8,), region="optimizer"),
        ),
    )
    out = annotate(inv)
    guesses = {t.name: t.module_guess for t in out.tensors}
    assert guesses == {
        "model.layers.0.input_layernorm.weight": "RMSNorm",
        "model.layers.0.mlp.up.weight": "Linear",
        "model.layers.0.mlp.up.bias": "Linear",
        "h.ln.weight": None,  # PyTorch's own LayerNorm: a fact, nothing to guess
        "h.ln.bias": None,
        "h.t5.weight": "RMSNorm",  # not PyTorch's own: its shape says weight-only norm
        "table.weight": None,  # a low guess names no type
        "state.0.exp_avg": None,
    }
    assert all(t.module is None for t in out.tensors if t.name.startswith("model."))  # the guess is not put in module
    assert annotate(out) is out  # idempotent
    # The structure reads facts only from module: a guess fed back in changes nothing.
    assert [(m.prefix, m.kind, m.confidence, m.type_name) for m in infer_modules(out)] == [
        (m.prefix, m.kind, m.confidence, m.type_name) for m in infer_modules(inv)
    ]
    assert Inventory("x", "test", ()) == annotate(Inventory("x", "test", ()))


def test_the_structure_travels_with_the_inventory_annotate_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``modules_of`` answers an annotated inventory from what it carries, after a pickle too (a fleet worker's report);
    an inventory made from it with other tensors is inferred anew, not answered from modules that are not its own."""
    inv = Inventory("x", "test", (rec("a.weight", (4, 4)), rec("a.bias", (4,)), rec("n.weight", (4,))))
    out = annotate(inv)
    calls = []
    monkeypatch.setattr(structure, "infer_modules", lambda i: calls.append(i) or [])
    assert [m.prefix for m in modules_of(out)] == ["a", "n"] and calls == []
    assert [m.prefix for m in modules_of(pickle.loads(pickle.dumps(out)))] == ["a", "n"] and calls == []
    assert modules_of(replace(out, bytes_read=7)) == list(out.inferred.modules) and calls == []  # same tensors
    fewer = replace(out, tensors=out.tensors[:2])
    assert modules_of(fewer) == [] and calls == [fewer]  # inferred again (here by the stand-in, which finds none)
    assert modules_of(replace(out, metadata={"input_casts": ["a"]})) == [] and len(calls) == 2


def test_a_measured_norm_forward_makes_the_kind_a_fact() -> None:
    table = {
        f"{p}/{x}": "float32" if "float32" in (p, x) or p != x else p
        for p in ("float32", "float16", "bfloat16")
        for x in ("float32", "float16", "bfloat16")
    }
    records = (rec("m.norm.weight", (8,), module="LlamaRMSNorm"),)
    (measured,) = infer_modules(Inventory("x", "t", records, metadata={"module_forward": {"LlamaRMSNorm": table}}))
    (guessed,) = infer_modules(Inventory("x", "t", records))
    assert (measured.kind, measured.confidence, measured.forward, measured.guessed_type) == ("norm", "fact", table, "RMSNorm")
    assert "measured on the meta device" in measured.provenance and measured.label == "LlamaRMSNorm"
    assert (guessed.confidence, guessed.forward) == ("high", None)


def test_wrapper_prefixes_are_for_naming_only() -> None:
    assert strip_wrappers("model_state_dict.module._orig_mod.fc.weight") == "fc.weight"
    assert strip_wrappers("state_dict.model.net.fc") == "net.fc"
    assert strip_wrappers("model") == "model" and strip_wrappers("modules.fc") == "modules.fc"
    found = modules(rec("model.fc.weight", (4, 8)), rec("model.fc.bias", (4,)), rec("fc.weight", (4, 8)), rec("fc.bias", (4,)))
    assert set(found) == {"model.fc", "fc"}  # grouped as written
    assert found["model.fc"].name == "fc" and found["fc"].name == "fc"


def test_root_tensors_and_optimizer_state() -> None:
    found = modules(
        rec("weight", (4, 8)),
        rec("bias", (4,)),
        rec("state.0.exp_avg", (4, 8), region="optimizer"),
    )
    assert set(found) == {""} and found[""].kind == "linear"
    assert by_tensor(found.values()) == {"weight": found[""], "bias": found[""]}


def test_module_file_and_leaf() -> None:
    found = modules(rec("fc.weight", (4, 8), file="a.safetensors"), rec("fc.bias", (4,), file="b.safetensors"))
    assert found["fc"].file is None
    assert modules(rec("fc.weight", (4, 8), file="a.safetensors"))["fc"].file == "a.safetensors"
    assert found["fc"].leaf("bias") is not None and found["fc"].leaf("nope") is None


def test_dominant_dtype_counts_compute_modules() -> None:
    half_model = [rec(f"l{i}.weight", (4, 4), "float16") for i in range(3)]
    # One forgotten fp32 layer, however large, does not make the rest the outliers.
    assert dominant_dtype(Inventory("x", "t", (*half_model, rec("big.weight", (4096, 4096)), rec("big.bias", (4096,))))) == "float16"
    # fp32 norms do not vote.
    norms = [rec(f"n{i}.{leaf}", (4,)) for i in range(10) for leaf in ("weight", "bias")]
    assert dominant_dtype(Inventory("x", "t", (*half_model, *norms))) == "float16"
    # Without compute modules: the floating dtype with the most elements; integers never count.
    assert dominant_dtype(Inventory("x", "t", (rec("a", (10,), "bfloat16"), rec("b", (3,)), rec("c", (99,), "int64")))) == "bfloat16"
    assert dominant_dtype(Inventory("x", "t", (rec("c", (9,), "int64"),))) is None
    # A tie of modules goes to the one with more elements.
    assert dominant_dtype(Inventory("x", "t", (rec("a.weight", (8, 8), "float16"), rec("b.weight", (8, 2))))) == "float16"


def test_on_real_checkpoints(training_pt: Path, lightning_ckpt: Path, tmp_path: Path) -> None:
    found = {m.prefix: m for m in infer_modules(read_checkpoint(training_pt))}
    assert set(found) == {"model.conv", "model.bn", "model.fc"}  # the Adam state is not a module
    assert [found[p].kind for p in sorted(found)] == ["batchnorm", "conv", "linear"]
    lit = {m.prefix: m for m in infer_modules(read_checkpoint(lightning_ckpt))}
    assert lit["state_dict.net.bn"].name == "net.bn" and lit["state_dict.net.bn"].kind == "batchnorm"
    path = tmp_path / "wrapped.pt"
    torch.save({"model_state_dict": TinyCNN().state_dict(), "optimizer_state_dict": {}}, path)
    assert {m.name for m in infer_modules(read_checkpoint(path))} == {"conv", "bn", "fc"}


def test_an_rnn_is_one_module_of_its_own_kind() -> None:
    """nn.LSTM's weight_ih_l0 ... bias_hh_l1_reverse are one module: guessed from names, a fact with --model."""
    lstm = nn.Sequential(nn.LSTM(4, 3, num_layers=2, bidirectional=True))
    for facts in (False, True):
        (m,) = infer_modules(inventory_of(lstm, facts=facts))
        assert (m.kind, m.confidence) == ("rnn", "fact" if facts else "high")
        assert len(m.kernel_tensors) == 16 and m.weight is not None and m.weight.name == "0.weight_ih_l0"


class RMSNorm(nn.Module):
    """Named like torch.nn.RMSNorm, but not it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


def test_module_types_are_matched_by_identity_not_name() -> None:
    """A user's class called RMSNorm is recorded by its qualified name, so torch.nn.RMSNorm's rules never apply."""
    from dtypeaudit.structure import type_name

    assert type_name(nn.RMSNorm) == "RMSNorm" and type_name(nn.Linear) == "Linear"
    assert type_name(RMSNorm) == f"{__name__}.RMSNorm"
    model = nn.Sequential(RMSNorm(), nn.RMSNorm(4))
    from dtypeaudit.formats import factory

    owners = {t.name: t.module for t in factory.inventory_of_model(model).tensors}
    assert owners == {"0.weight": f"{__name__}.RMSNorm", "1.weight": "RMSNorm"}


def test_a_module_made_again_with_other_tensors_derives_from_its_own() -> None:
    """What a module derives is worked out once per kind and signature; ``dataclasses.replace`` with other tensors must
    not answer from the signature of the tensors it had."""
    from dtypeaudit.inventory import TensorRecord
    from dtypeaudit.structure import infer_modules

    weight, bias = TensorRecord("l.0.weight", "float32", (4, 4), 64), TensorRecord("l.0.bias", "float32", (4,), 16)
    (m,) = infer_modules([weight, bias])
    assert (m.kind, m.dtype, m.weight) == ("linear", "float32", weight)
    half = tuple(t.with_(dtype="bfloat16", nbytes=t.nbytes // 2) for t in m.tensors)
    assert (replace(m, tensors=half).dtype, replace(m, tensors=half).kernel_dtypes) == ("bfloat16", frozenset({"bfloat16"}))
    assert replace(m, tensors=(bias,)).weight is None
    assert replace(m, tensors=(bias, weight)).weight is weight
    assert replace(m, input_cast=True).signature == m.signature  # the same tensors keep it
