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


# The child rewrites its own source in place (same size, other bytes, as a `torch.save` over it does to a file
# of the same layout) when it first opens its finished temporary to verify it: after every byte was read.
REWRITE_CHILD = """
import os, runpy, sys
source = sys.argv[1]
done = []
def hook(event, args):
    if event != "open" or done:
        return
    name = os.path.basename(str(args[0]))
    if ".dtypeaudit-" in name and name.endswith(".tmp") and args[1] == "r":
        done.append(1)
        fd = os.open(source, os.O_WRONLY)
        os.pwrite(fd, b"\\x01" * 64, os.path.getsize(source) - 64)
        os.close(fd)
sys.addaudithook(hook)
sys.argv = ["dtypeaudit", *sys.argv[2:]]
runpy.run_module("dtypeaudit", run_name="__main__")
"""


def test_a_source_rewritten_during_convert_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    import subprocess
    import sys

    from safetensors.torch import save_file

    from .helpers import ROOT

    source = tmp_path / "model.safetensors"
    save_file({f"w{i}": torch.randn(64, 64) for i in range(4)}, str(source))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    args = [sys.executable, "-c", REWRITE_CHILD, str(source), "convert", str(source), "--to", "fp16"]
    r = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"dtypeaudit: error: {source}: the source changed while it was being converted (rewritten, replaced or removed); "
        "nothing was written: convert it again once it is written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no output, no temporary


def test_convert_refuses_a_config_json_over_the_cap(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "padding": "x" * (64 << 20)}))
    out = tmp_path.parent / f"{tmp_path.name}-fp16"
    r = run_cli("convert", str(tmp_path), "--to", "fp16", "-o", str(out), process=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {tmp_path / 'config.json'}: JSON file is over the 64 MiB cap"]
    assert not out.exists()


def test_a_folder_that_is_not_one_checkpoint_says_what_it_lacks(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))  # no config.json: from_pretrained would not load it
    r = run_cli("convert", str(tmp_path), "--to", "fp16")
    assert r.returncode == 2
    assert "no config.json or numbered shards beside its weight files" in r.stderr and "no *.safetensors" not in r.stderr
    assert run_cli("scan", str(tmp_path), "-q").returncode == 0  # a scan reads each file apart
