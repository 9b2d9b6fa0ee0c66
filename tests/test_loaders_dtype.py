"""Which dtype from_pretrained gives the model: every way config.json, the index and the weights decide it,
compared with transformers' own from_pretrained (default arguments) on folders written by save_pretrained."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtypeaudit.checks import check, loaded_dtype
from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import Inventory, TensorRecord
from dtypeaudit.policy import load_policy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _gpt2(path: Path, dtype: torch.dtype = torch.float16, **save: Any) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    transformers.GPT2LMHeadModel(cfg).to(dtype).save_pretrained(str(path), **save)
    return path


def _t5(path: Path, dtype: torch.dtype = torch.float16) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(cfg).to(dtype).save_pretrained(str(path))
    return path


def _set_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()


def _real(path: Path) -> dict[str, str]:
    """The dtypes of the model transformers builds from the folder, with from_pretrained's default arguments."""
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(path))
    return {k: str(v.dtype)[6:] for k, v in model.state_dict().items()}


def _ours(inv: Inventory) -> dict[str, str]:
    loaded = loaded_dtype(inv)
    return {t.name: loaded.get(t.name, t.dtype) for t in inv.tensors}


def _assert_same(path: Path) -> Inventory:
    inv = read_checkpoint(path)
    real, ours = _real(path), _ours(inv)
    shared = set(real) & set(ours)
    assert len(shared) >= len(ours) - 1  # every stored tensor is a model tensor (GPT-2 may store a tied copy)
    assert {n: ours[n] for n in shared} == {n: real[n] for n in shared}
    return inv


@pytest.mark.parametrize(
    ("changes", "want"),
    [
        ({"dtype": "float32", "torch_dtype": "float16"}, "float32"),  # dtype is read before torch_dtype
        ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),  # a null dtype lets torch_dtype decide
        ({"dtype": _DROP, "torch_dtype": "float32"}, "float32"),
        ({"dtype": {}}, "float32"),  # a dict: its "" entry, else torch's default
        ({"dtype": {"": "bfloat16"}}, "bfloat16"),
        ({"dtype": "half"}, "float16"),  # getattr(torch, "half")
        ({"dtype": _DROP, "torch_dtype": _DROP}, "float16"),  # no config dtype: the weights' own
    ],
)
def test_the_loaded_dtype_follows_from_pretrained(tmp_path: Path, changes: dict[str, Any], want: str) -> None:
    path = _gpt2(tmp_path / "m")
    _set_config(path, **changes)
    inv = _assert_same(path)
    floating = {d for n, d in _ours(inv).items() if "float" in d}
    assert floating == {want}


@pytest.mark.parametrize("value", ["auto", "fp16", "torch.float16"])
def test_a_dtype_torch_does_not_have_is_refused(tmp_path: Path, value: str) -> None:
    path = _gpt2(tmp_path / "m")
    _set_config(path, dtype=value)
    with pytest.raises(AttributeError):
        _real(path)
    with pytest.raises(CheckpointError, match="not a torch dtype; from_pretrained fails on it"):
        read_checkpoint(path)


def test_a_duplicate_key_keeps_the_last_value(tmp_path: Path) -> None:
    path = _gpt2(tmp_path / "m")
    _set_config(path, dtype=_DROP, torch_dtype=_DROP)
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[:-1] + ', "dtype": "float16", "dtype": "float32"}')
    inv = _assert_same(path)
    assert set(_ours(inv).values()) == {"float32"}
    assert [f.rule for f in inv.findings if f.rule == "duplicate-key"] == ["duplicate-key"]


def test_without_a_config_dtype_the_first_floating_tensor_decides(tmp_path: Path) -> None:
    """Two fp32 tensors whose names sort first in an otherwise fp16 file make the whole model fp32."""
    path = _gpt2(tmp_path / "m")
    _set_config(path, dtype=_DROP, torch_dtype=_DROP)
    tensors = load_file(str(path / "model.safetensors"))
    first = sorted(tensors)[:2]
    for name in first:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    inv = _assert_same(path)
    assert set(_ours(inv).values()) == {"float32"}
    assert any(f.rule == "load-cast" and f.actual == "float32" for f in check(inv))


def test_the_index_metadata_dtype_decides_a_sharded_folder(tmp_path: Path) -> None:
    path = _gpt2(tmp_path / "m", max_shard_size="2KB")
    index_path = path / "model.safetensors.index.json"
    assert index_path.is_file()
    _set_config(path, dtype=_DROP, torch_dtype=_DROP)
    index = json.loads(index_path.read_text())
    index.setdefault("metadata", {})["dtype"] = "bfloat16"
    index_path.write_text(json.dumps(index))
    inv = _assert_same(path)
    assert {d for d in _ours(inv).values() if "float" in d} == {"bfloat16"}


def test_keep_in_fp32_modules_stay_float32_under_float16(tmp_path: Path) -> None:
    import transformers

    assert transformers.T5ForConditionalGeneration._keep_in_fp32_modules  # the class keeps some modules in fp32
    path = _t5(tmp_path / "t5")
    inv = _assert_same(path)
    kept = {n for n, d in _ours(inv).items() if d == "float32"}
    assert kept and all(".wo." in n for n in kept)
    assert {t.dtype for t in inv.tensors if t.name in kept} == {"float16"}  # stored fp16, loaded fp32


def _verdict(dtypes_by_name: dict[str, str], policy: str) -> bool:
    """Whether a policy passes a model whose tensors have these dtypes."""
    tensors = tuple(TensorRecord(name=n, dtype=d, shape=(1,), nbytes=0) for n, d in dtypes_by_name.items())
    found = check(Inventory("loaded", "safetensors", tensors), load_policy(policy))
    return not [f for f in found if f.severity == "error" and f.rule == "dtype-mismatch"]


@pytest.mark.parametrize(
    ("changes", "policy"),
    [
        ({"dtype": "float32"}, "fp16"),  # fp16 weights cast to fp32 on load: an fp16 gate fails
        ({"dtype": "float16"}, "fp16"),
        ({"dtype": _DROP, "torch_dtype": _DROP}, "fp16"),
        ({"dtype": "bfloat16"}, "bf16"),
        ({"dtype": "float32", "torch_dtype": "float16"}, "fp16"),
    ],
)
def test_the_policy_verdict_is_the_loaded_models(tmp_path: Path, changes: dict[str, Any], policy: str) -> None:
    path = _gpt2(tmp_path / "m")
    _set_config(path, **changes)
    inv = read_checkpoint(path)
    ours = not [f for f in check(inv, load_policy(policy)) if f.severity == "error"]
    assert ours == _verdict(_real(path), policy)
    if not ours:
        assert any("as from_pretrained loads it; stored as float16" in f.message for f in check(inv, load_policy(policy)))
