"""Tied weights written to safetensors: the default output says how to load it; --materialize-ties writes every name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers import run_cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def gpt2_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ties") / "gpt2.pt"
    state = _gpt2().state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()  # tied, as transformers ties it
    torch.save(state, path)
    return path


def test_the_default_output_says_how_to_load_the_tie(gpt2_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    proc = run_cli("convert", str(gpt2_pt), "--to", "fp16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    note = next(line for line in proc.stdout.splitlines() if line.startswith("note: lm_head.weight is stored once"))
    assert "safetensors.torch.load_model" in note and "tie_weights()" in note and "--materialize-ties" in note
    # What the note says is so: a strict load of load_file misses the alias ...
    loaded = safetensors_torch.load_file(out)
    assert "lm_head.weight" not in loaded
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        _gpt2().half().load_state_dict(loaded)
    # ... and the loads it names restore it.
    source = torch.load(gpt2_pt, weights_only=True)
    model = _gpt2().half()
    safetensors_torch.load_model(model, out)
    assert torch.equal(model.lm_head.weight, source["transformer.wte.weight"].half())
    other = _gpt2().half()
    missing, unexpected = other.load_state_dict(loaded, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    other.tie_weights()
    assert torch.equal(other.lm_head.weight, source["transformer.wte.weight"].half())


def test_materialize_ties_writes_what_load_file_users_get_back(gpt2_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    proc = run_cli("convert", str(gpt2_pt), "--to", "fp16", "-o", str(out), "--materialize-ties")
    assert proc.returncode == 0, proc.stderr
    assert "stored once" not in proc.stdout and "verified" in proc.stdout
    source = torch.load(gpt2_pt, weights_only=True)
    loaded = safetensors_torch.load_file(out)
    assert set(loaded) == set(source)
    for name, tensor in source.items():
        want = tensor.half() if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    model = _gpt2().half()
    model.load_state_dict(loaded)  # strict, as a plain load_file user does it
    assert torch.equal(model.lm_head.weight, source["lm_head.weight"].half())


def test_materialize_ties_needs_a_safetensors_output(gpt2_pt: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(gpt2_pt), "--to", "fp16", "-o", str(tmp_path / "x.pt"), "--materialize-ties")
    assert proc.returncode == 2 and "--materialize-ties applies to a .safetensors output" in proc.stderr
    assert not (tmp_path / "x.pt").exists()
