"""Faults and bad input on real converts and real writers: one line each, exit 2, the source as its writer left
it, and nothing of ours left behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import ROOT

# The child converts; when the chosen point of the convert comes (the first open of its temporary for writing, or
# for reading back to verify: after every byte was read once; as the source is mapped; as the first piece of a
# dry run's value checks is made), another process truncates or rewrites the source,
# as a `torch.save` over the file being converted does, and the child waits for it. The writer prints the sha256
# of what it left.
TRUNCATE_CHILD = """
import os, runpy, subprocess, sys
source, stage, how = sys.argv[1:4]
done = []
WRITERS = {
    "torch.save": "import torch, sys; torch.save({'small': torch.ones(3)}, sys.argv[1])",
    "truncate": "import os, sys; os.truncate(sys.argv[1], os.path.getsize(sys.argv[1]) // 3)",
}
PRINT = "; import hashlib; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())"
def chosen(event, args):
    if stage == "map":
        return event == "mmap.__new__" and sys._getframe(2).f_code.co_filename.endswith("mapped.py")
    if stage == "values":
        return event == "call" and args.f_code.co_name == "make" and args.f_code.co_filename.endswith("pieces.py")
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return False
    name = os.path.basename(os.fsdecode(args[0]))
    return ".dtypeaudit-" in name and name.endswith(".tmp") and (args[1] == "r") == (stage == "verify")
def hook(event, args):
    if not done and chosen(event, args):
        done.append(1)
        sys.stdout.write(subprocess.run([sys.executable, "-c", WRITERS[how] + PRINT, source], capture_output=True,
                                        text=True, check=True).stdout)
sys.addaudithook(hook)
if stage == "values":
    import threading
    profile = lambda frame, event, arg: hook(event, frame)
    sys.setprofile(profile)
    threading.setprofile(profile)
sys.argv = ["dtypeaudit", *sys.argv[4:]]
runpy.run_module("dtypeaudit", run_name="__main__")
"""


CHANGED = (
    "the source changed while it was being converted (rewritten, replaced or removed); nothing was written: "
    "convert it again once it is written"
)


def _leases_work(where: Path) -> bool:
    """Whether this process may take a read lease on a file in ``where`` (the protection under test)."""
    import fcntl

    probe = where / "probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")
@pytest.mark.parametrize("how", ["torch.save", "truncate"])
@pytest.mark.parametrize("stage", ["write", "verify"])
@pytest.mark.parametrize("kind", ["pt", "safetensors"])
def test_a_source_truncated_during_convert_is_refused_in_one_line(tmp_path: Path, kind: str, stage: str, how: str) -> None:
    """It was a SIGBUS from the mapped source: exit 135, no message, the temporary left."""
    if not _leases_work(tmp_path):
        pytest.skip("this file system gives no read leases")
    from safetensors.torch import save_file

    weights = {f"w{i}": torch.randn(256, 256) for i in range(8)}  # 2 MiB: pages past a third of it are read late
    source = tmp_path / f"model.{kind}"
    if kind == "pt":
        torch.save(weights, source)
    else:
        save_file(weights, str(source))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    args = [sys.executable, "-c", TRUNCATE_CHILD, str(source), stage, how, "convert", str(source), "--to", "fp16"]
    r = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {source}: {CHANGED}"]
    # the source is what its writer left, and nothing else is there: no output, no temporary
    assert hashlib.sha256(source.read_bytes()).hexdigest() == r.stdout.split()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


def _truncated_run(tmp_path: Path, source: Path, stage: str, how: str, *args: str) -> subprocess.CompletedProcess[str]:
    if not _leases_work(tmp_path):
        pytest.skip("this file system gives no read leases")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    command = [sys.executable, "-c", TRUNCATE_CHILD, str(source), stage, how, "convert", str(source), *args]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")
@pytest.mark.parametrize("stage", ["map", "values"])
def test_a_source_truncated_during_a_dry_runs_value_checks_gives_no_verdict(tmp_path: Path, stage: str) -> None:
    """What is read after the truncation is not the file's: the dry run says the source changed instead of judging it."""
    source = tmp_path / "model.pt"
    torch.save({f"w{i}": torch.full((256, 256), 1e6) for i in range(8)}, source)  # every value overflows float16
    r = _truncated_run(tmp_path, source, stage, "truncate", "--to", "fp16", "--dry-run", "--check-values")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {source}: {CHANGED}"]
    assert hashlib.sha256(source.read_bytes()).hexdigest() == r.stdout.split()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


@pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")
@pytest.mark.parametrize("stage", ["write", "verify"])
def test_a_quantized_source_truncated_while_it_is_dequantized(tmp_path: Path, stage: str) -> None:
    import gguf
    import numpy as np

    source = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    rng = np.random.default_rng(0)
    for i in range(8):
        data = rng.standard_normal((256, 256)).astype(np.float32)
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(f"blk.{i}.ffn_up.weight", gguf.quants.quantize(data, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out.safetensors"
    r = _truncated_run(tmp_path, source, stage, "truncate", "--to", "fp16", "-o", str(out))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {source}: {CHANGED}"]
    assert hashlib.sha256(source.read_bytes()).hexdigest() == r.stdout.split()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


@pytest.mark.skipif(sys.platform != "linux", reason="read leases are Linux's")
def test_a_mapping_reads_zeros_once_a_writer_came_and_closing_says_the_source_changed(tmp_path: Path) -> None:
    """The path of a read straight from the mapping (the value checks hand it to numpy): no SIGBUS, zeros, and the
    sources' close refuses whatever was made of them."""
    import threading
    from contextlib import ExitStack

    from safetensors.torch import save_file

    from dtypeaudit.conversion.mapped import LEASES, open_sources
    from dtypeaudit.errors import ConversionError
    from dtypeaudit.formats import read_checkpoint

    if threading.current_thread() is not threading.main_thread() or not _leases_work(tmp_path):
        pytest.skip("leases are taken from the main thread, on a file system that gives them")
    source = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(512, 512)}, str(source))
    inv = read_checkpoint(source)
    with pytest.raises(ConversionError, match="the source changed while it was being converted"), ExitStack() as stack:
        (src,) = open_sources(source, inv, stack).values()
        assert id(src) in LEASES.held
        assert bytes(src.mm[-4:]) == torch.ones(1).numpy().tobytes()
        truncate = "import os, sys; os.truncate(sys.argv[1], 100)"
        subprocess.run([sys.executable, "-c", truncate, str(source)], check=True, timeout=120)
        assert src.lost and source.stat().st_size == 100
        assert bytes(src.mm[-4096:]) == bytes(4096)  # past the new end: zeros, not SIGBUS
    assert not LEASES.held


def _gguf_with_dims(path: Path, dims: list[int]) -> None:
    """A GGUF file from gguf's own writer, its first tensor's dims (innermost first) patched to ``dims``."""
    import struct

    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.zeros((4, 8), np.float32))
    writer.add_tensor("b", np.ones((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", 1) + b"a" + struct.pack("<I", 2)  # the name "a", then its two dims
    at = data.index(key) + len(key)
    data[at : at + 16] = struct.pack("<QQ", *dims)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "dims",
    [[0, 1 << 62], [1 << 62, 0], [0, 1 << 63], [1 << 32, 1 << 32], [1 << 62, 4], [1 << 31, (1 << 31) + 1], [1 << 63, 1], [0, 8], [8, 0]],
)
def test_gguf_dims_the_loaders_cannot_count_are_refused(tmp_path: Path, dims: list[int]) -> None:
    """A zero dim beside a huge one is no empty tensor to gguf-py (numpy: "array is too big") nor to llama.cpp
    (its element count must be an int64): it passed as one. A plain zero-size tensor still reads."""
    import gguf

    from .helpers import run_cli

    path = tmp_path / "m.gguf"
    _gguf_with_dims(path, dims)
    try:
        reference = {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(str(path)).tensors}
    except ValueError:
        reference = None
    r = run_cli("scan", str(path), "-q", process=True)
    if reference is None:
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"dtypeaudit: error: {path}: GGUF tensor 'a' has dims {dims}, whose sizes overflow a 64-bit count; "
            "llama.cpp and gguf-py refuse it"
        ]
    else:
        assert r.returncode == 0, r.stderr
        assert reference["a"] == tuple(dims)  # gguf-py's shapes are innermost first too


def _sharded_gpt2(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny GPT-2 written by save_pretrained in two shards and an index; its state dict as loaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder, max_shard_size="40KB")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _rename_in_index(folder: Path, shard: str, to: str) -> None:
    import json

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: (to if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


def _from_pretrained(folder: Path) -> dict[str, torch.Tensor] | str:
    from transformers import GPT2LMHeadModel

    try:
        return GPT2LMHeadModel.from_pretrained(folder).state_dict()
    except Exception as exc:  # what the loader says, for the comparison
        return type(exc).__name__


def test_a_shard_path_through_a_subfolder_that_stays_inside_is_read(tmp_path: Path) -> None:
    """``sub/../shard`` opens the folder's own shard, as from_pretrained reads it: it was refused."""
    import json

    from .helpers import run_cli

    folder = tmp_path / "m"
    expected = _sharded_gpt2(folder)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 2
    (folder / "sub").mkdir()
    _rename_in_index(folder, shards[0], f"sub/../{shards[0]}")
    loaded = _from_pretrained(folder)
    assert not isinstance(loaded, str) and all(torch.equal(loaded[k], v) for k, v in expected.items())

    r = run_cli("scan", str(folder), "-f", "json", process=True)
    assert r.returncode == 0, r.stderr
    (checkpoint,) = json.loads(r.stdout)["checkpoints"]
    held = {t["name"] for t in checkpoint["tensors"]}
    assert set(loaded) - held <= {"lm_head.weight"}  # the tied head is no tensor of the files
    out = tmp_path / "out"
    c = run_cli("convert", str(folder), "--to", "fp16", "-o", str(out), process=True)
    assert c.returncode == 0, c.stderr
    converted = _from_pretrained(out)
    assert not isinstance(converted, str)
    assert all(torch.equal(converted[k], v.to(torch.float16).to(converted[k].dtype)) for k, v in expected.items())


@pytest.mark.parametrize("where", ["up", "link", "missing"])
def test_a_shard_path_that_leaves_the_folder_or_is_missing_is_refused(tmp_path: Path, where: str) -> None:
    """What leaves the folder is refused, lexically (``../``) or through a link (``link/..`` walks the link's
    parent); a path through a folder that is not there is missing to the loader too."""
    import shutil

    from .helpers import run_cli

    folder = tmp_path / "m"
    _sharded_gpt2(folder)
    shard = sorted(p.name for p in folder.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere" / "deeper"
    outside.mkdir(parents=True)
    shutil.copy(folder / shard, outside.parent / shard)  # the same bytes, outside the folder
    name = {"up": f"sub/../../elsewhere/{shard}", "link": f"link/../{shard}", "missing": f"missing/../{shard}"}[where]
    (folder / "sub").mkdir()
    os.symlink(outside, folder / "link")  # link/.. is tmp_path/elsewhere
    _rename_in_index(folder, shard, name)
    loaded = _from_pretrained(folder)
    if where == "missing":
        assert isinstance(loaded, str)  # the loader cannot open it
        why = f"shard '{name}' named by the index is missing"
    else:
        assert not isinstance(loaded, str)  # the loader reads the copy outside: that is what is refused
        why = f"shard name '{name}' leaves the directory; refused"
    r = run_cli("scan", str(folder), "-q", process=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"dtypeaudit: error: {folder / 'model.safetensors.index.json'}: {why}"]


def _views_file(path: Path, where: str, value: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A torch.save file whose tensors view parts of larger storages, ``value`` planted where ``where`` says:
    outside every view (``hidden``), inside one (``seen``, in the strided view ``t``), or inside the one of two views
    of a storage that sees it (``shared``: ``v``, not ``w``)."""
    torch.manual_seed(0)
    flat = torch.randn(100, dtype=dtype)
    grid = torch.randn(10, 10, dtype=dtype)
    if where == "hidden":
        flat[0] = flat[99] = value  # w sees 10..19, v sees 40..49
        grid[:, 0] = value  # t is grid[:, 1:]: column 0 is no tensor's
    elif where == "seen":
        grid[3, 4] = value
    else:  # "shared": seen by v alone, of the two views of its storage
        flat[45] = value
    state = {"w": flat[10:20], "v": flat[40:50], "t": grid[:, 1:], "b": torch.ones(3, dtype=dtype)}
    torch.save(state, path)
    return state


@pytest.mark.parametrize("value", [float("nan"), 1e6, float("inf")])
@pytest.mark.parametrize("where", ["hidden", "seen", "shared"])
def test_values_outside_every_view_are_carried_not_judged(tmp_path: Path, where: str, value: float) -> None:
    """torch.save writes a view's whole storage, but torch.load gives only what the views see: a NaN or 1e6 in
    the rest was refused, and named a tensor that does not see it."""
    import json

    from .helpers import run_cli

    source = tmp_path / "views.pt"
    _views_file(source, where, value)
    loaded = torch.load(source, weights_only=True)
    fits = all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 65504 for t in loaded.values())
    assert fits == (where == "hidden")  # what the loader gives: the reference
    scan = run_cli("scan", str(source), "--values", "-f", "json")
    findings = json.loads(scan.stdout)["checkpoints"][0]["findings"]
    convert = run_cli("convert", str(source), "--to", "fp16", "-o", str(tmp_path / "out.pt"))
    if where == "hidden":
        assert scan.returncode == 0 and findings == [], findings
        assert convert.returncode == 0, convert.stdout + convert.stderr
        out = torch.load(tmp_path / "out.pt", weights_only=True)
        for name, t in loaded.items():
            assert torch.equal(out[name], t.to(torch.float16)), name  # each view as torch casts it
            assert out[name].untyped_storage().nbytes() == t.untyped_storage().nbytes() // 2  # the storage carried whole
    else:
        assert scan.returncode == 1
        # named by the tensor that sees it
        assert {f["tensor"] for f in findings if f["severity"] == "error"} == {"t" if where == "seen" else "v"}
        assert convert.returncode == 1 and not (tmp_path / "out.pt").exists()


def test_a_value_outside_the_views_of_a_storage_left_as_it_is_is_not_judged(tmp_path: Path) -> None:
    """The same for a float16 file (nothing to cast: its NaN/Inf alone are looked for)."""
    from .helpers import run_cli

    source = tmp_path / "half.pt"
    _views_file(source, "hidden", float("nan"), torch.float16)
    r = run_cli("scan", str(source), "--values", "-q")
    assert r.returncode == 0, r.stdout
    import json

    for where, tensor in (("seen", "t"), ("shared", "v")):
        _views_file(source, where, float("nan"), torch.float16)
        r = run_cli("scan", str(source), "--values", "-f", "json")
        assert r.returncode == 1
        assert [f["tensor"] for f in json.loads(r.stdout)["checkpoints"][0]["findings"] if f["rule"] == "non-finite"] == [tensor]


def test_a_casts_error_figures_are_of_the_viewed_values(tmp_path: Path) -> None:
    """float64's errors are measured by torch's own cast (``measure_errors``): of the viewed values too."""
    from dtypeaudit.conversion import convert

    torch.manual_seed(0)
    flat = torch.randn(100, dtype=torch.float64)
    flat[0] = 60001.3  # float16 rounds it by 1.3: no tensor sees it
    source = tmp_path / "f64.pt"
    torch.save({"w": flat[10:20]}, source)
    view = torch.load(source, weights_only=True)["w"]
    result = convert(source, "fp16", dry_run=True, read_values=True)
    (stats,) = result.plan.values.values()
    assert stats.max_abs_error == pytest.approx(float((view - view.half().double()).abs().max()), rel=1e-6)
