"""Where convert may write: never inside the folder it reads, never over a folder that holds its source."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from .helpers import run_cli


def _folder(root: Path) -> Path:
    from safetensors.torch import save_file

    model = root / "model"
    model.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    return model


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out", ["model/sub", "model/sub/deeper"])
def test_an_output_inside_the_source_folder_is_refused(tmp_path: Path, out: str) -> None:
    source = _folder(tmp_path)
    (source / "sub").mkdir()
    before = _tree(tmp_path)
    r = run_cli("convert", str(source), "--to", "fp16", "-o", str(tmp_path / out))
    assert r.returncode == 2
    assert "inside the source folder" in r.stderr and str(tmp_path / out) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert _tree(tmp_path) == before  # nothing written


def test_an_output_that_would_replace_a_folder_holding_the_source_is_refused(tmp_path: Path) -> None:
    holder = tmp_path / "models"
    holder.mkdir()
    source = _folder(holder)
    before = _tree(tmp_path)
    r = run_cli("convert", str(source), "--to", "fp16", "-o", str(holder), "--force")
    assert r.returncode == 2
    assert "holds the source" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _tree(tmp_path) == before
    single = holder / "w.pt"
    torch.save({"w": torch.ones(2)}, single)
    r = run_cli("convert", str(single), "--to", "fp16", "-o", str(tmp_path), "--force")
    assert r.returncode == 2 and "holds the source" in r.stderr and single.exists()


def test_an_output_beside_the_source_folder_is_fine(tmp_path: Path) -> None:
    source = _folder(tmp_path)
    r = run_cli("convert", str(source), "--to", "fp16", "-o", str(tmp_path / "model-x"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model-x"]
