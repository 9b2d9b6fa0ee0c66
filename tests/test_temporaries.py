"""A convert killed with SIGKILL leaves its temporary: scans pass it over, the next run in that directory removes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtypeaudit import temporaries

from .helpers import ROOT, run_cli

# The child stops itself (SIGSTOP) when it opens its finished temporary again to verify it: the writer runs as
# it always does, and the test kills it at a known point, the whole output written and not yet renamed.
CHILD = """
import os, signal, sys
def hook(event, args):
    name = os.path.basename(str(args[0])) if event == "open" else ""
    if name.startswith(".") and ".dtypeaudit-" in name and name.endswith(".tmp") and args[1] == "r":
        os.kill(os.getpid(), signal.SIGSTOP)
sys.addaudithook(hook)
from dtypeaudit.cli import main
sys.argv = ["dtypeaudit", *sys.argv[1:]]
main()
"""


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_killed_convert_leaves_a_temporary_the_next_run_removes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = tmp_path / "model.pt"
    torch.save({f"layer{i}.weight": torch.randn(256, 256) for i in range(8)}, source)  # 2 MiB of float32
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, "convert", str(source), "--to", "fp16"], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not _stopped(child.pid):
            assert child.poll() is None, "the convert finished before it was stopped"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    temp = temporaries.parse(left.name)
    assert temp is not None and temp.pid == child.pid and temp.dest == "model.fp16.pt"
    assert left.stat().st_size > 8 * 256 * 256 * 2  # the whole fp16 output, left behind
    assert not (tmp_path / "model.fp16.pt").exists()

    # A scan of the directory passes it over, with a note, and reads the real checkpoint.
    scan = run_cli("scan", str(tmp_path), "-f", "json", process=True)  # the note is a log line on stderr
    assert scan.returncode == 0, scan.stdout
    assert [c["path"] for c in json.loads(scan.stdout)["checkpoints"]] == [str(source)]
    assert f"skipping {left}" in scan.stderr and "has ended" in scan.stderr

    # A live run's temporary, and one of another host, are not ours to remove.
    live = tmp_path / f".other.pt.dtypeaudit-{temporaries.this_host()}-{os.getpid()}.tmp"
    elsewhere = tmp_path / f".other.pt.dtypeaudit-otherhost-{child.pid}.tmp"
    live.write_bytes(b"x")
    elsewhere.write_bytes(b"x")

    # The next convert in that directory removes what the killed one left.
    again = run_cli("convert", str(source), "--to", "bf16", process=True)
    assert again.returncode == 0, again.stderr
    assert not left.exists() and f"removed {left}" in again.stderr
    assert live.exists() and elsewhere.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.pt", "model.bf16.pt", live.name, elsewhere.name])


def test_names_round_trip_and_other_names_are_not_temporaries(tmp_path: Path) -> None:
    path = temporaries.temporary_path(tmp_path / "a.b.safetensors")
    t = temporaries.parse(path.name)
    assert t == temporaries.Temporary("a.b.safetensors", temporaries.this_host(), os.getpid())
    assert not temporaries.is_stale(t)  # this very process
    assert temporaries.parse(".model.pt.dtypeaudit-4242.tmp") == temporaries.Temporary("model.pt", None, 4242)  # older releases
    for name in ("model.pt", ".model.pt.tmp", "model.pt.dtypeaudit-1.tmp", ".model.pt.dtypeaudit-x.tmp"):
        assert temporaries.parse(name) is None


# A convert --in-place of a folder, stopped by SIGKILL at a chosen point of its swap. An audit hook runs before the
# operation it is told of, so the child kills itself as it is about to rename its finished .tmp into place (the
# source already moved aside to its .old), or to remove the old copy (at the .tmp name, after the exchange).
# `_exchange` is the real renameat2 call unless the child turns it off (the fallback of a system without
# RENAME_EXCHANGE).
SWAP_CHILD = """
import os, runpy, signal, sys
kill_on, no_exchange = sys.argv[1], sys.argv[2] == "1"
if no_exchange:
    import dtypeaudit.conversion.atomic as atomic
    atomic._exchange = lambda a, b: False
def hook(event, args):
    name = os.path.basename(str(args[0])) if event == kill_on else ""
    if ".dtypeaudit-" in name and name.endswith(".tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
sys.argv = ["dtypeaudit", *sys.argv[3:]]
runpy.run_module("dtypeaudit", run_name="__main__")
"""


def _folder(root: Path) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = root / "model"
    model.mkdir()
    save_file({f"layers.{i}.weight": torch.randn(128, 128) for i in range(4)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "gpt2", "dtype": "float32"}')
    return model


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _killed_in_place(folder: Path, kill_on: str, *, no_exchange: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    args = [sys.executable, "-c", SWAP_CHILD, kill_on, "1" if no_exchange else "0", "convert", str(folder), "--to", "fp16", "--in-place"]
    child = subprocess.run(args, env=env, cwd=folder.parent, capture_output=True, text=True, timeout=240)
    assert child.returncode == -signal.SIGKILL, child.stderr


def _dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_in_place_folder_killed_between_the_two_renames_is_restored_not_removed(tmp_path: Path) -> None:
    source = _folder(tmp_path)
    before = _digests(source)
    _killed_in_place(source, "os.rename", no_exchange=True)  # killed between the two renames
    assert not source.exists(), sorted(p.name for p in tmp_path.iterdir())
    (moved,) = [p for p in tmp_path.iterdir() if p.name.endswith(".old")]
    assert _digests(moved) == before  # the only copy, intact

    # A scan of the missing folder says where it is, in one line, exit 2; a scan of the parent passes the copy over.
    missing = run_cli("scan", str(source), process=True)
    assert missing.returncode == 2
    assert moved.name in missing.stderr and "mv" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

    # The next convert in that folder renames it back, never removes it, and the half-made output goes.
    other = tmp_path / "other.pt"
    torch.save({"w": torch.ones(2)}, other)
    again = run_cli("convert", str(other), "--to", "bf16", process=True)
    assert again.returncode == 0, again.stderr
    assert f"restored {source}" in again.stderr
    assert _digests(source) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "other.bf16.pt", "other.pt"]

    # And the source still converts in place.
    done = run_cli("convert", str(source), "--to", "fp16", "--in-place", process=True)
    assert done.returncode == 0, done.stderr
    assert _dtypes(source) == {"F16"} and sorted(p.name for p in tmp_path.iterdir()) == ["model", "other.bf16.pt", "other.pt"]


def test_in_place_folder_swap_is_one_exchange(tmp_path: Path) -> None:
    from dtypeaudit.conversion import atomic

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not atomic._exchange(a, b):
        pytest.skip("this filesystem cannot exchange two names in one step (the fallback is tested above)")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()

    source = _folder(tmp_path)
    _killed_in_place(source, "shutil.rmtree", no_exchange=False)  # killed after the exchange, before the old copy goes
    assert _dtypes(source) == {"F16"}  # the converted folder is in place: there was no moment without one
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert left.name.endswith(".tmp") and _dtypes(left) == {"F32"}
    again = run_cli("convert", str(source), "--to", "bf16", "-o", str(tmp_path / "model-bf16"), process=True)
    assert again.returncode == 0, again.stderr
    assert not left.exists() and f"removed {left}" in again.stderr
