"""convert: real writers in, real readers out; values equal torch's own cast; nothing else changes."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dtypeaudit.conversion import convert
from dtypeaudit.errors import ConversionError
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.policy import load_policy

from . import oracle
from .helpers import ROOT, all_dtypes_state, facts, run_cli, sharing
from .models import TinyCNN, TinyLM


def non_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every non-tensor leaf by path, for 'identical in meaning' comparisons."""
    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        return out
    if isinstance(obj, dict):
        if hasattr(obj, "_metadata"):
            out[f"{prefix}._metadata"] = obj._metadata
        if type(obj) is not dict and not isinstance(obj, torch.nn.modules.container.OrderedDict):  # type: ignore[attr-defined]
            out[f"{prefix}.__class__"] = type(obj).__qualname__
        for k, v in obj.items():
            out.update(non_tensors(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(non_tensors(v, f"{prefix}.{i}"))
    else:
        out[prefix] = obj
    return out


def test_state_dict_to_fp16_equals_torch_cast(all_dtypes_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    result = convert(all_dtypes_pt, "fp16", output=out)
    assert result.output == out and not result.unsafe
    src = oracle.load(all_dtypes_pt)
    got = oracle.load(out)
    assert list(got) == list(src)
    for name, t in src.items():
        if t.dtype in (torch.float32, torch.float64, torch.bfloat16):
            assert got[name].dtype == torch.float16, name
            assert torch.equal(got[name], t.to(torch.float16)), name
        else:
            assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
        assert got[name].stride() == t.stride() and got[name].storage_offset() == t.storage_offset(), name
    assert oracle.sharing(got) == oracle.sharing(src)
    assert isinstance(got["param"], torch.nn.Parameter)
    # mmap loading needs the 64-byte alignment torch.save uses.
    assert torch.equal(torch.load(out, weights_only=True, mmap=True)["base"], src["base"].half())


def test_tied_model_halves_and_stays_tied(tmp_path: Path) -> None:
    src, out = tmp_path / "lm.pt", tmp_path / "lm16.pt"
    torch.save(TinyLM(vocab=2000, dim=64).state_dict(), src)
    convert(src, "fp16", output=out)
    got = torch.load(out, weights_only=True)
    assert got["lm_head.weight"].data_ptr() == got["embed.weight"].data_ptr()
    # One storage for the tie, at half the width: the file halves (it would not if the tie were split).
    assert 0.45 < out.stat().st_size / src.stat().st_size < 0.55
    assert sharing(read_checkpoint(out)) == sharing(read_checkpoint(src))


def test_lightning_checkpoint_keeps_everything_but_the_dtype(lightning_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "lit16.ckpt"
    convert(lightning_ckpt, "fp16", output=out)
    src = torch.load(lightning_ckpt, weights_only=False)  # our own fixture: safe to load fully
    got = torch.load(out, weights_only=False)
    assert non_tensors(got) == non_tensors(src)
    assert type(got["hyper_parameters"]).__qualname__ == "AttributeDict"
    assert got["state_dict"]._metadata == src["state_dict"]._metadata
    for k, v in src["state_dict"].items():
        assert torch.equal(got["state_dict"][k], v.half() if v.is_floating_point() else v), k
    # Optimizer state is untouched by default: a resumed run keeps its fp32 moments.
    for i, state in src["optimizer_states"][0]["state"].items():
        for k, v in state.items():
            assert got["optimizer_states"][0]["state"][i][k].dtype == v.dtype and torch.equal(got["optimizer_states"][0]["state"][i][k], v)


def test_include_and_strip_optimizer(training_pt: Path, tmp_path: Path) -> None:
    inc, strip = tmp_path / "inc.pt", tmp_path / "strip.pt"
    # Adam's second moments are ~1e-10 and vanish in fp16, so the refusal is right; bf16 keeps them.
    assert convert(training_pt, "fp16", output=inc, include_optimizer=True).unsafe
    convert(training_pt, "bf16", output=inc, include_optimizer=True)
    convert(training_pt, "fp16", output=strip, strip_optimizer=True)
    got = torch.load(inc, weights_only=True)
    assert got["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    stripped = torch.load(strip, weights_only=True)
    assert set(stripped) == {"model", "epoch"} and stripped["epoch"] == 3
    assert strip.stat().st_size < inc.stat().st_size


def test_a_plan_is_made_whole_and_never_edited(training_pt: Path) -> None:
    """--strip-optimizer's dropped tensors are in the one plan made (not a second one made after), and a plan,
    once made, cannot be changed: a step that knows more derives a new one."""
    import dataclasses

    r = convert(training_pt, "fp16", strip_optimizer=True, dry_run=True, read_values=False)
    assert r.plan.counts().get("drop", 0) > 0
    assert all(p.reason.endswith("(--strip-optimizer)") for p in r.plan.tensors if p.action == "drop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.plan.values = {}  # type: ignore[misc]


def test_legacy_to_zip(legacy_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "from_legacy.pt"
    convert(legacy_pt, "bf16", output=out)
    assert read_checkpoint(out).format == "torch-zip"
    src, got = oracle.load(legacy_pt), oracle.load(out)
    for name, t in src.items():
        want = t.to(torch.bfloat16) if t.dtype in (torch.float32, torch.float64, torch.float16) else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_pt_to_safetensors_writes_ties_once(tied_lm_pt: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "lm.safetensors"
    convert(tied_lm_pt, "fp16", output=out)
    src = torch.load(tied_lm_pt, weights_only=True)
    with safe_open(str(out), "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        for k in keys:
            assert torch.equal(f.get_tensor(k), src[k].half()), k
    assert "lm_head.weight" not in keys and json.loads(meta["dtypeaudit.aliases"]) == {"lm_head.weight": "embed.weight"}


def test_pt_with_views_to_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    src = tmp_path / "views.pt"
    torch.save({"base": base, "col": base[:, 1], "t": base.t()}, src)
    out = tmp_path / "views.safetensors"
    convert(src, "fp16", output=out)
    got = load_file(str(out))
    assert torch.equal(got["col"], base[:, 1].half()) and torch.equal(got["t"], base.t().half())


def test_non_tensor_content_refused_for_safetensors(training_pt: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="non-tensor content .*epoch"):
        convert(training_pt, "fp16", output=tmp_path / "x.safetensors", strip_optimizer=True)
    assert not (tmp_path / "x.safetensors").exists()


def test_safetensors_to_safetensors(safetensors_file: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "out.safetensors"
    convert(safetensors_file, "fp32", output=out)
    src, got = load_file(str(safetensors_file)), load_file(str(out))
    for k, v in src.items():
        want = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
        assert got[k].dtype == want.dtype and torch.equal(got[k].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), k


def test_hf_directory_loads_back_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    src = tmp_path / "gpt2"
    model.save_pretrained(src, max_shard_size="20KB")
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "gpt2-fp16"
    convert(src, "fp16", output=out)
    assert (out / "tokenizer.json").read_text() == "{}"
    config = json.loads((out / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_checkpoint(out).tensors)
    assert index["weight_map"] == json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    back = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float16).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model.half()(ids).logits.float()
        got = back(ids).logits.float()
    assert torch.allclose(got, expected, atol=1e-2, rtol=1e-2)


def test_hf_bin_directory(hf_bin_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bin16"
    convert(hf_bin_dir, "bf16", output=out)
    for shard in sorted(hf_bin_dir.glob("*.bin")):
        src, got = oracle.load(shard), oracle.load(out / shard.name)
        assert {k: v.to(torch.bfloat16) for k, v in src.items()}.keys() == got.keys()
        assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in src.items())


def _overflowing(tmp_path: Path) -> Path:
    path = tmp_path / "big_values.pt"
    torch.save({"ok": torch.ones(4), "huge": torch.tensor([1.0, 70000.0, -1e6, 2.0]), "tiny": torch.full((10,), 1e-9)}, path)
    return path


def test_overflow_refused_and_nothing_written(tmp_path: Path) -> None:
    src = _overflowing(tmp_path)
    before = src.read_bytes()
    proc = run_cli("convert", str(src), "--to", "fp16")
    assert proc.returncode == 1
    assert "huge: 2 values beyond ±65504 would become inf" in proc.stdout
    assert "tiny: 10 non-zero values below 5.96e-08 would become 0 (100.00% of non-zero)" in proc.stdout
    assert not (tmp_path / "big_values.fp16.pt").exists() and src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big_values.pt"]


def test_clamp_saturates_and_keep_unsafe_keeps(tmp_path: Path) -> None:
    src = _overflowing(tmp_path)
    clamped = tmp_path / "clamped.pt"
    convert(src, "fp16", output=clamped, clamp=True, keep=("tiny",))
    got = torch.load(clamped, weights_only=True)
    assert got["huge"].tolist() == [1.0, 65504.0, -65504.0, 2.0] and got["huge"].dtype == torch.float16
    kept = tmp_path / "kept.pt"
    convert(src, "fp16", output=kept, keep_unsafe=True)
    got = torch.load(kept, weights_only=True)
    assert (got["huge"].dtype, got["tiny"].dtype, got["ok"].dtype) == (torch.float32, torch.float32, torch.float16)


def test_nan_is_refused_even_with_clamp(tmp_path: Path) -> None:
    src = tmp_path / "nan.pt"
    torch.save({"w": torch.tensor([1.0, float("nan")])}, src)
    result = convert(src, "fp16", clamp=True)
    assert result.output is None and result.unsafe[0].nonfinite == 1


def test_policy_keeps_and_output_passes_the_policy(tmp_path: Path) -> None:
    src = tmp_path / "cnn.pt"
    torch.save(TinyCNN().state_dict(), src)
    out = tmp_path / "cnn16.pt"
    assert run_cli("convert", str(src), "--to", "fp16", "--preset", "fp16-mixed", "-o", str(out)).returncode == 0
    assert run_cli("scan", str(out), "--preset", "fp16-mixed").returncode == 0
    got = torch.load(out, weights_only=True)
    assert got["bn.running_var"].dtype == torch.float32 and got["conv.weight"].dtype == torch.float16
    assert got["bn.num_batches_tracked"].dtype == torch.int64


def test_dry_run_shows_the_plan(tied_lm_pt: Path) -> None:
    proc = run_cli("convert", str(tied_lm_pt), "--to", "fp16", "--dry-run", "--keep", "*norm*")
    assert proc.returncode == 0 and proc.stdout.startswith("plan: ")
    assert "kept by rule" in proc.stdout and "keep: --keep *norm*" in proc.stdout
    assert not tied_lm_pt.with_name("tied_lm.fp16.pth").exists()
    doc = json.loads(run_cli("convert", str(tied_lm_pt), "--to", "fp16", "--dry-run", "-f", "json").stdout)
    assert doc["dry_run"] and doc["output"] is None and doc["nbytes"][1] < doc["nbytes"][0]


def test_refuses_to_overwrite_input(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3)}, src)
    (tmp_path / "link.pt").symlink_to(src)
    os.link(src, tmp_path / "hard.pt")
    before = src.read_bytes()
    for target in (src, tmp_path / "link.pt", tmp_path / "hard.pt", tmp_path / "." / "m.pt"):
        proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(target))
        assert proc.returncode == 2 and "output is the input itself" in proc.stderr, target
    assert src.read_bytes() == before
    existing = tmp_path / "existing.pt"
    existing.write_bytes(b"keep me")
    proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(existing))
    assert proc.returncode == 2 and "already exists; pass --force" in proc.stderr and existing.read_bytes() == b"keep me"
    assert run_cli("convert", str(src), "--to", "fp16", "-o", str(existing), "--force").returncode == 0
    missing = run_cli("convert", str(src), "--to", "fp16", "-o", str(tmp_path / "no" / "x.pt"))
    assert missing.returncode == 2 and "output directory does not exist" in missing.stderr


def test_in_place_keeps_mode(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3)}, src)
    os.chmod(src, 0o640)
    assert run_cli("convert", str(src), "--to", "fp16", "--in-place").returncode == 0
    assert torch.load(src, weights_only=True)["w"].dtype == torch.float16
    assert (src.stat().st_mode & 0o777) == 0o640


def test_disk_full_leaves_source_and_no_partial_output(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.randn(256, 256) for i in range(8)}, src)
    before = src.read_bytes()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "dtypeaudit", "convert", str(src), "--to", "fp16"], capture_output=True, text=True, preexec_fn=limit, env=env
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "m.fp16.pt: could not write the output: File too large; nothing was written" in proc.stderr
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_interrupt_leaves_source_and_no_partial_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtypeaudit import pieces

    src = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.randn(64, 64) for i in range(4)}, src)
    before = src.read_bytes()
    calls = {"n": 0}
    real = pieces.Maker.make

    def interrupt_on_second_piece(self: pieces.Maker, piece: pieces.Piece) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, piece)

    monkeypatch.setattr(pieces.Maker, "make", interrupt_on_second_piece)
    with pytest.raises(KeyboardInterrupt):
        convert(src, "fp16")
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_verification_catches_a_wrong_write_in_the_writers_casts(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's casts made wrong, and npcast's one-shot cast too: verification recasts its samples with a
    second implementation (``reference_cast``), so a bug in the writer's casting code is caught, torch or not."""
    import numpy as np

    from dtypeaudit import npcast
    from dtypeaudit.npcast import NumpyCaster

    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(8)}, src)
    real = NumpyCaster._cast
    monkeypatch.setattr(NumpyCaster, "_cast", lambda self, x, looked=None: np.add(real(self, x, looked), 1, casting="unsafe"))
    assert npcast.cast(np.ones(2, np.float32), "float32", "float16").tolist() != [1.0, 1.0]  # npcast shares the bug
    with pytest.raises(ConversionError, match="differs from a second cast of the source"):
        convert(src, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


@pytest.mark.parametrize(("fixture", "reason"), [("torchscript_pt", "TorchScript"), ("dcp_dir", "dcp_to_torch_save")])
def test_torchscript_and_dcp_refused_with_a_reason(fixture: str, reason: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    proc = run_cli("convert", str(path), "--to", "fp16")
    assert proc.returncode == 2
    assert reason in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_scan_values(tmp_path: Path) -> None:
    src = _overflowing(tmp_path)
    proc = run_cli("scan", str(src), "--values", "-f", "json")
    assert proc.returncode == 1
    findings = {(f["rule"], f["tensor"], f["severity"]) for f in json.loads(proc.stdout)["checkpoints"][0]["findings"]}
    assert findings == {("fp16-overflow", "huge", "error"), ("fp16-underflow", "tiny", "error")}


def test_all_dtypes_round_trip_through_bf16_and_back(all_dtypes_pt: Path, tmp_path: Path) -> None:
    mid, back = tmp_path / "mid.pt", tmp_path / "back.pt"
    convert(all_dtypes_pt, "bf16", output=mid)
    convert(mid, "fp32", output=back)
    assert facts(read_checkpoint(back)) == {
        k: ("float32" if v[0] in ("float64", "float32", "float16", "bfloat16") else v[0], v[1], v[2])
        for k, v in facts(read_checkpoint(all_dtypes_pt)).items()
    }
    state = all_dtypes_state()
    assert torch.equal(torch.load(back, weights_only=True)["base"], state["base"].to(torch.bfloat16).float())


def test_preset_policy_object_api(tmp_path: Path) -> None:
    src = tmp_path / "lm.pt"
    torch.save(TinyLM().state_dict(), src)
    result = convert(src, "fp16", policy=load_policy("fp16-mixed"), dry_run=True)
    kept = {p.tensor.name for p in result.plan.tensors if p.action == "keep"}
    assert {"norm.weight", "norm.bias", "layers.0.norm.weight"} <= kept
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_max_shard_size_reshards(hf_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "resharded"
    convert(hf_dir, "fp16", output=out, max_shard_size="200B")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((out / s).is_file() for s in shards)
    assert not any((out / p.name).exists() for p in hf_dir.glob("model-*.safetensors") if p.name not in shards)
    src: dict[str, torch.Tensor] = {}
    for shard in hf_dir.glob("*.safetensors"):
        src |= load_file(str(shard))
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(out / shard))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 200 or len(part) == 1
        got |= part
    assert got.keys() == src.keys() and all(torch.equal(got[k], v.half()) for k, v in src.items())
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in src.values())
    assert run_cli("scan", str(out), "-f", "json").returncode == 0


def on_a_terminal(*args: str) -> tuple[int, bytes, bytes]:
    """``python -m dtypeaudit ARGS`` with stderr on a pseudo-terminal: exit status, stdout, what the terminal showed.

    The terminal is read while the command runs: a progress bar that refreshes for long enough (a loaded machine)
    fills the pty's buffer, and a command blocked writing to it would never exit.
    """
    import pty
    import threading

    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "dtypeaudit", *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command's end of the terminal is closed
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, stdout, b"".join(seen)


def test_progress_bar_on_a_terminal_and_not_in_logs(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.randn(512, 512) for i in range(8)}, src)
    returncode, stdout, seen = on_a_terminal("convert", str(src), "--to", "fp16")
    assert returncode == 0
    assert b"writing" in seen  # the value checks are folded from the chunks the writer casts
    assert b"\x1b[" not in stdout and b"writing" not in stdout  # the report itself stays clean
    returncode, stdout, seen = on_a_terminal("convert", str(src), "--to", "fp16", "--dry-run", "--check-values")
    assert returncode == 0 and b"checking values" in seen and b"checking values" not in stdout
    piped = run_cli("convert", str(src), "--to", "bf16", "-o", str(tmp_path / "b.pt"))
    assert piped.returncode == 0 and piped.stderr == ""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scan_values_finds_nan_in_half_precision_checkpoints(tmp_path: Path, dtype: torch.dtype) -> None:
    src = tmp_path / "half.pt"
    torch.save({"ok": torch.ones(3, dtype=dtype), "bad": torch.tensor([1.0, float("nan"), float("inf")], dtype=dtype)}, src)
    proc = run_cli("scan", str(src), "--values", "-f", "json")
    assert proc.returncode == 1
    findings = [(f["rule"], f["tensor"], f["message"]) for f in json.loads(proc.stdout)["checkpoints"][0]["findings"]]
    assert findings == [("non-finite", "bad", "2 NaN/Inf values already present")]


def test_dry_run_is_metadata_only_unless_values_are_asked_for(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"big": torch.tensor([1.0, 7e4, -2e5]), "w": torch.randn(64, 64)}, src)
    plan = run_cli("convert", str(src), "--to", "fp16", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "tensors: 2 cast; size" in plan.stdout and "values: not read (--check-values reads them" in plan.stdout
    assert "unsafe" not in plan.stdout and "cast error" not in plan.stdout
    doc = json.loads(run_cli("convert", str(src), "--to", "fp16", "--dry-run", "-f", "json").stdout)
    assert doc["values_read"] is False and doc["values"] == [] and doc["unsafe"] == []
    checked = run_cli("convert", str(src), "--to", "fp16", "--dry-run", "--check-values")
    assert checked.returncode == 1 and "unsafe values" in checked.stdout
    assert "big: 2 values beyond ±65504 would become inf" in checked.stdout and "values: not read" not in checked.stdout
    doc = json.loads(run_cli("convert", str(src), "--to", "fp16", "--dry-run", "--check-values", "-f", "json").stdout)
    assert doc["values_read"] is True and doc["unsafe"] == ["big"] and {v["tensors"] for v in doc["values"]} == {"big", "w"}
    alone = run_cli("convert", str(src), "--to", "fp16", "--check-values", "-o", str(tmp_path / "o.pt"))
    assert alone.returncode == 2 and "--check-values reads the values for a plan: give --dry-run too" in alone.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_metadata_only_dry_run_never_imports_torch(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(8, 8), "b": torch.zeros(8, dtype=torch.float64)}, src)
    proc = run_cli("convert", str(src), "--to", "bf16", "--dry-run", process=True, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0 and "tensors: 2 cast" in proc.stdout, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "dtypeaudit.conversion" in imported and "torch" not in imported and "numpy" not in imported


def test_dry_run_value_checks_show_progress_on_a_terminal(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({f"w{i}": torch.randn(512, 512) for i in range(8)}, src)
    returncode, stdout, seen = on_a_terminal("convert", str(src), "--to", "fp16", "--dry-run", "--check-values")
    assert returncode == 0 and b"cast error (worst 5 of 8)" in stdout
    assert b"checking values" in seen and b"\x1b[" not in stdout
    returncode, stdout, seen = on_a_terminal("convert", str(src), "--to", "fp16", "--dry-run")
    assert returncode == 0 and b"values: not read" in stdout and b"checking values" not in seen


def test_one_floating_test_one_half_set_and_one_byte_counter(tmp_path: Path) -> None:
    """dtypes.is_floating (float8 included, ints and bools not), one half-precision set for the structure rules and
    the trace checks, and inventory.floating_bytes: the bytes torch gives each floating dtype of a saved file, which
    is what convert's config.json dtype is chosen from."""
    from dtypeaudit import dtypes, structure
    from dtypeaudit.conversion.plan import weights_dtype
    from dtypeaudit.inventory import floating_bytes
    from dtypeaudit.trace.result import LOW_PRECISION

    assert structure.HALF_DTYPES is dtypes.HALF and LOW_PRECISION is dtypes.HALF
    assert dtypes.HALF == {str(d).removeprefix("torch.") for d in (torch.float16, torch.bfloat16)}
    state = {
        "emb.weight": torch.zeros(8, 4, dtype=torch.float16),
        "norm.weight": torch.ones(4, dtype=torch.float32),
        "q.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
        "ids": torch.arange(6),
        "mask": torch.ones(3, dtype=torch.bool),
    }
    for dtype in (torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.bool):
        assert dtypes.is_floating(str(dtype).removeprefix("torch.")) == dtype.is_floating_point
    assert not dtypes.is_floating("not-a-dtype")
    path = tmp_path / "m.pt"
    torch.save(state, path)
    inv = read_checkpoint(str(path))
    want: dict[str, int] = {}
    for t in state.values():
        if t.is_floating_point():
            name = str(t.dtype).removeprefix("torch.")
            want[name] = want.get(name, 0) + t.numel() * t.element_size()
    assert dict(floating_bytes(inv.tensors)) == want == {"float16": 64, "float32": 16, "float8_e4m3fn": 16}
    assert weights_dtype(inv) == "float16"  # no compute layer the structure knows: the dtype with the most bytes


def _both_indexes(path: Path) -> dict[str, torch.Tensor]:
    """huggingface_hub's own sharded writers (save_pretrained's, and transformers 4's .bin one): safetensors shards
    and model.safetensors.index.json beside pytorch_model-*.bin shards and pytorch_model.bin.index.json."""
    import warnings

    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(32, 32) for i in range(4)}
    path.mkdir()
    save_torch_state_dict(state, path, max_shard_size="5KB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_torch_state_dict(state, path, safe_serialization=False, max_shard_size="5KB")
    (path / "config.json").write_text(json.dumps({"model_type": "tiny", "torch_dtype": "float32"}))
    return state


def test_the_index_from_pretrained_reads_is_rewritten_and_the_other_copied(tmp_path: Path) -> None:
    """modeldir.output_index: from_pretrained resolves the output as the source (the safetensors index first), so
    that index gets the converted sizes (re-packed: a new weight map); the .bin index names .bin shards the
    conversion copies untouched, and is copied untouched (it used to be dropped)."""
    from safetensors.torch import load_file

    src = tmp_path / "both"
    state = _both_indexes(src)
    bin_index = (src / "pytorch_model.bin.index.json").read_bytes()
    for out, repack in ((tmp_path / "fp16", None), (tmp_path / "packed", "5KB")):
        convert(src, "fp16", output=out, max_shard_size=repack)
        assert (out / "pytorch_model.bin.index.json").read_bytes() == bin_index
        assert all((out / p.name).read_bytes() == p.read_bytes() for p in src.glob("*.bin"))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        loaded = {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(shard).items()}
        assert {k: v.dtype for k, v in loaded.items()} == dict.fromkeys(state, torch.float16)
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in loaded.values()) == 4 * 32 * 32 * 2
        assert {k: (out / f).is_file() for k, f in index["weight_map"].items()} == dict.fromkeys(state, True)
        assert all(torch.equal(load_file(out / index["weight_map"][k])[k], v.half()) for k, v in state.items())
    assert (
        json.loads((tmp_path / "packed" / "model.safetensors.index.json").read_text())["weight_map"]
        != json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_directory_result_holds_each_files_written_record(tmp_path: Path) -> None:
    """write_directory returns one verify.Written per file it wrote (Result.written), as safetensors loads each."""
    import zlib

    from safetensors.torch import load_file

    src = tmp_path / "both"
    _both_indexes(src)
    r = convert(src, "bf16", output=tmp_path / "out", max_shard_size="5KB")
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 1 and sorted(r.written) == shards
    for name in shards:
        loaded = load_file(tmp_path / "out" / name)
        assert r.written[name].tensors == {k: ("bfloat16", tuple(v.shape)) for k, v in loaded.items()}
        assert r.written[name].crcs == {k: zlib.crc32(v.view(torch.uint8).numpy().tobytes()) for k, v in loaded.items()}
