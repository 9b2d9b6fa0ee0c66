"""Bad input that used to be taken for a bug of ours: one line each, exit 2, and the rest still read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .helpers import run_cli


def test_link_loops_in_a_folder_are_bad_input_and_the_rest_is_read(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    os.symlink("self.pt", tmp_path / "self.pt")  # a file linking to itself
    os.symlink("two.bin", tmp_path / "one.bin")  # two files linking to each other
    os.symlink("one.bin", tmp_path / "two.bin")
    r = run_cli("scan", str(tmp_path), "-f", "json", process=True)
    assert r.returncode == 2 and "internal error" not in r.stderr
    checkpoints = {Path(c["path"]).name: c for c in json.loads(r.stdout)["checkpoints"]}
    assert sorted(checkpoints) == ["a.pt", "one.bin", "self.pt", "two.bin"]
    assert [t["name"] for t in checkpoints["a.pt"]["tensors"]] == ["w"] and checkpoints["a.pt"]["error"] is None
    loops = ("one.bin", "self.pt", "two.bin")
    why = "a symbolic link loop (the link leads back to itself)"
    for name in loops:
        assert checkpoints[name]["error"] == f"{tmp_path / name}: {why}"
    assert sorted(r.stderr.strip().splitlines()) == sorted(f"dtypeaudit: error: {tmp_path / n}: {why}" for n in loops)

    alone = run_cli("scan", str(tmp_path / "self.pt"), "-q", process=True)
    assert alone.returncode == 2 and "symbolic link loop" in alone.stderr and "did you mean" not in alone.stderr


def test_a_link_loop_beside_a_model_folders_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    os.symlink("extra.bin", tmp_path / "extra.bin")
    r = run_cli("scan", str(tmp_path), "-f", "json", process=True)
    assert r.returncode == 2 and "internal error" not in r.stderr, r.stderr
    # every file of a model folder is read for safety: the folder is refused in one line naming the file, and
    # the line says the way through
    (line,) = r.stderr.strip().splitlines()
    assert "extra.bin: cannot read (Too many levels of symbolic links)" in line and "--exclude" in line
    ok = run_cli("scan", str(tmp_path), "-f", "json", "--exclude", "extra.bin", process=True)
    assert ok.returncode == 0, ok.stderr
    assert [t["name"] for t in json.loads(ok.stdout)["checkpoints"][0]["tensors"]] == ["w"]


def test_one_json_cap_for_every_reader_of_config_json(tmp_path: Path) -> None:
    """A config.json over the 64 MiB cap is refused before anything parses it: by the folder's reader (it was taken
    for no config at all, so the verdict was not about the model from_pretrained builds) and before transformers
    parses it for --model (a 200 MB one took 47 s and 2.8 GB)."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 10, "n_positions": 8}
    (tmp_path / "config.json").write_text(json.dumps({**config, "padding": "x" * (64 << 20)}))
    why = f"{tmp_path / 'config.json'}: JSON file is over the 64 MiB cap"
    for args in (("scan", str(tmp_path)), ("scan", str(tmp_path / "model.safetensors"), "--model", str(tmp_path))):
        r = run_cli(*args, "-q", process=True)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {why}"], args
