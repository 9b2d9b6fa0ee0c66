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
