"""safetensors files and Hugging Face directories: header-only reads that match the safetensors package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint

from . import oracle
from .helpers import facts, write_sharded


def _package_facts(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (str(f.get_tensor(k).dtype)[6:], tuple(f.get_tensor(k).shape), "unknown") for k in f.keys()}  # noqa: SIM118


def test_single_file_matches_the_package(safetensors_file: Path) -> None:
    inv = read_checkpoint(safetensors_file)
    assert inv.format == "safetensors"
    assert facts(inv) == _package_facts(safetensors_file)
    assert inv.metadata["safetensors_metadata"] == {"format": "pt"}
    assert inv.by_name()["embed.weight"].nbytes == 16 * 4 * 2


def test_sharded_directory_with_index(hf_dir: Path) -> None:
    inv = read_checkpoint(hf_dir)
    assert inv.format == "hf-directory"
    expected: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        expected |= _package_facts(shard)
    assert facts(inv) == expected
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert {t.name: t.file for t in inv.tensors} == index["weight_map"]
    assert inv.metadata["config_dtype"] == "float32"
    assert inv.findings == ()


def test_bin_shards_with_index(hf_bin_dir: Path) -> None:
    inv = read_checkpoint(hf_bin_dir)
    expected: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for shard in sorted(hf_bin_dir.glob("*.bin")):
        expected |= oracle.facts(oracle.load(shard))
    assert facts(inv) == expected
    assert inv.findings == ()


def test_bare_shards_without_index(hf_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    (bare / "model.safetensors.index.json").unlink()
    assert facts(read_checkpoint(bare)) == facts(read_checkpoint(hf_dir))


def test_index_and_shards_disagree(hf_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    del index["weight_map"][first]
    index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    findings = {(f.rule, f.tensor, f.severity) for f in read_checkpoint(broken).findings}
    assert findings == {("index-mismatch", "ghost.weight", "error"), ("index-mismatch", first, "warning")}


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_shard_names_are_confined(hf_dir: Path, tmp_path: Path, shard: str) -> None:
    broken = tmp_path / "escape"
    shutil.copytree(hf_dir, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["evil"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="leaves the directory"):
        read_checkpoint(broken)


def test_shard_symlink_leading_outside(hf_dir: Path, tmp_path: Path, safetensors_file: Path) -> None:
    broken = tmp_path / "linked"
    shutil.copytree(hf_dir, broken)
    (broken / "evil.safetensors").symlink_to(safetensors_file)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["evil"] = "evil.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="link that leads outside"):
        read_checkpoint(broken)


def test_missing_shard(hf_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "missing"
    shutil.copytree(hf_dir, broken)
    victim = sorted(broken.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{victim.name}' named by the index is missing"):
        read_checkpoint(broken)


def test_tensor_stored_in_two_shards(tmp_path: Path) -> None:
    state = {"a": torch.ones(2), "b": torch.ones(3)}
    d = write_sharded(tmp_path / "dup", state, 2)
    from safetensors.torch import save_file

    second = sorted(d.glob("*.safetensors"))[1]
    save_file({"b": torch.ones(3), "a": torch.ones(2)}, str(second))
    findings = [(f.rule, f.tensor) for f in read_checkpoint(d).findings]
    assert ("index-mismatch", "a") in findings


def test_dcp_directory_matches_what_was_saved(dcp_dir: Path) -> None:
    inv = read_checkpoint(dcp_dir)
    assert inv.format == "dcp"
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    expected = {
        name: (str(m.properties.dtype)[6:], tuple(m.size), "unknown")
        for name, m in meta.state_dict_metadata.items()
        if hasattr(m, "properties")
    }
    assert facts(inv) == expected
    assert inv.by_name()["model.bn.running_mean"].dtype == "float16"
    assert inv.by_name()["extra.scale"].dtype == "bfloat16"
    assert inv.findings == ()
    assert all(t.file.endswith(".distcp") for t in inv.tensors)


def test_transformers_save_pretrained_directory(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, eos_token_id=0, bos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path / "gpt2", max_shard_size="20KB")
    inv = read_checkpoint(tmp_path / "gpt2")
    assert inv.format == "hf-directory" and len(inv.metadata["shards"]) > 2  # type: ignore[arg-type]
    # transformers writes each tied weight once (lm_head.weight is wte's): the rest is the state_dict.
    expected = {k: (str(v.dtype)[6:], tuple(v.shape), "unknown") for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert facts(inv) == expected
    # generation_config.json holds no weights and no loader reads it as a checkpoint: one of a model folder's usual
    # files, read for safety and no news
    assert inv.findings == ()
