"""diff on checkpoints written by the real writers: values compared from the bytes, wrapper prefixes seen
through, ties reported once, repeated layers folded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dtypeaudit.conversion import convert
from dtypeaudit.diff import decode, diff, minifloat_table
from dtypeaudit.formats import read_checkpoint

from .helpers import json_report, run_cli


class Blocks(nn.Module):
    """Eight repeated blocks, 68 tensors, which diff once listed one line each."""

    def __init__(self, layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(8), "q": nn.Linear(8, 8), "k": nn.Linear(8, 8), "mlp": nn.Linear(8, 8)})
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Blocks().state_dict()


def test_a_changed_weight_is_reported_and_tolerance_decides(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    state = _state()
    torch.save(state, a)
    changed = {k: v.clone() for k, v in state.items()}
    changed["layers.3.q.weight"][1, 2] += 1e-3
    torch.save(changed, b)

    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("~ layers.3.q.weight  values differ (max abs diff 0.001")
    assert lines[-1].startswith("0 added, 0 removed, 1 changed (1 values)") and len(lines) == 4

    proc = run_cli("diff", str(a), str(b), "--tolerance", "1e-2")
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-1].startswith("identical: 68 tensors, same names, dtypes, shapes, ties and values (within 0.01")

    code, doc, _ = json_report("diff", str(a), str(b))
    assert code == 1 and doc["values"] == "crc32"
    (entry,) = doc["changed"]
    assert entry["name"] == "layers.3.q.weight" and entry["values"] == "differ" and entry["dtype"] == ["float32", "float32"]
    assert math.isclose(entry["max_abs_diff"], 1e-3, rel_tol=1e-3)
    # Identical files are identical by the bytes.
    proc = run_cli("diff", str(a), str(a))
    assert proc.returncode == 0 and "identical: 68 tensors" in proc.stdout and "(CRC-32)" in proc.stdout


def test_wrappers_are_seen_through(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Blocks()
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    wrapped = {
        "dataparallel.pt": nn.DataParallel(model).state_dict(),  # module.
        "compiled.pt": torch.compile(model).state_dict(),  # _orig_mod.
        "lightning.ckpt": {"state_dict": model.state_dict(), "epoch": 1},  # state_dict.
    }
    opt = torch.optim.Adam(model.parameters())
    wrapped["tutorial.pt"] = {"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict()}
    for name, obj in wrapped.items():
        path = tmp_path / name
        torch.save(obj, path)
        assert next(iter(read_checkpoint(path).by_name())) != "embed.weight"  # it is wrapped
        proc = run_cli("diff", str(path), str(plain))
        assert proc.returncode == 0, (name, proc.stdout)
        assert "identical: 68 tensors" in proc.stdout and "names compared without" in proc.stdout.splitlines()[0]
        assert run_cli("diff", str(plain), str(path)).returncode == 0
    d = diff(read_checkpoint(tmp_path / "tutorial.pt"), read_checkpoint(plain))
    assert d.prefix_a == "model_state_dict." and d.prefix_b == "" and not d.differs  # Adam before a step holds no state


def test_training_checkpoint_against_its_plain_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    train, plain = tmp_path / "train.pt", tmp_path / "plain.pt"
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "epoch": 1}, train)
    torch.save(model.state_dict(), plain)
    d = diff(read_checkpoint(train), read_checkpoint(plain))
    assert not d.changed and not d.added and d.prefix_a == "model_state_dict."
    assert {t.name for t in d.removed} == {
        f"optimizer_state_dict.state.{i}.{m}" for i in range(4) for m in ("exp_avg", "exp_avg_sq", "step")
    }


def _gpt2(tmp_path: Path) -> tuple[Path, Path]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    tied, untied = tmp_path / "tied.pt", tmp_path / "untied.pt"
    torch.save(state, tied)
    torch.save({**state, "lm_head.weight": state["lm_head.weight"].clone()}, untied)
    return tied, untied


def test_a_broken_tie_is_reported(tmp_path: Path) -> None:
    tied, untied = _gpt2(tmp_path)
    proc = run_cli("diff", str(tied), str(untied))
    assert proc.returncode == 1
    assert "! tie broken: lm_head.weight = transformer.wte.weight (one storage in A, separate in B)" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("0 added, 0 removed, 0 changed, 1 tie broken")
    proc = run_cli("diff", str(untied), str(tied))
    assert proc.returncode == 1 and "! tie created: lm_head.weight = transformer.wte.weight" in proc.stdout
    code, doc, _ = json_report("diff", str(tied), str(untied))
    assert code == 1 and doc["ties"] == [{"names": ["lm_head.weight", "transformer.wte.weight"], "change": "broken", "views": False}]


def test_tied_tensors_are_one_row(tmp_path: Path) -> None:
    tied, _ = _gpt2(tmp_path)
    half = tmp_path / "half.pt"
    convert(tied, "fp16", output=half)
    proc = run_cli("diff", str(tied), str(half))
    assert proc.returncode == 1
    assert "~ transformer.wte.weight = lm_head.weight  float32 -> float16" in proc.stdout.splitlines()
    assert "tie" not in proc.stdout.splitlines()[-1]  # the tie held through the conversion


def test_a_converted_model_folds_its_layers(tmp_path: Path) -> None:
    src, half = tmp_path / "fp32.pt", tmp_path / "fp16.pt"
    torch.save(_state(), src)
    convert(src, "fp16", output=half)
    proc = run_cli("diff", str(src), str(half))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) <= 15, proc.stdout
    assert "~ layers.{0..7}.q.weight  ×8  float32 -> float16" in lines
    assert lines[-1].startswith("0 added, 0 removed, 68 changed (68 dtype); size")
    verbose = run_cli("diff", str(src), str(half), "--verbose").stdout.splitlines()
    assert len(verbose) == 68 + 3 and "~ layers.5.k.bias  float32 -> float16" in verbose
    # Under a tolerance the cast's error is measured; the folded row shows the largest.
    proc = run_cli("diff", str(src), str(half), "--tolerance", "1e-2")
    assert proc.returncode == 1  # the dtypes changed, whatever the values
    row = next(line for line in proc.stdout.splitlines() if line.startswith("~ layers.{0..7}.q.weight  ×8"))
    assert "values within 0.01 (max abs diff up to " in row
    d = diff(read_checkpoint(src), read_checkpoint(half), tolerance=1e-2)
    exact = max(float((v - v.half().float()).abs().max()) for v in _state().values())
    assert max(c.values.max_abs_diff for c in d.changed if c.values and c.values.max_abs_diff is not None) == exact


def test_views_compare_by_what_they_hold(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    views, copies = tmp_path / "views.pt", tmp_path / "copies.pt"
    torch.save({"base": base, "col": base[:, 1], "t": base.t(), "row": base[2]}, views)
    torch.save({"base": base.clone(), "col": base[:, 1].clone(), "t": base.t().contiguous(), "row": base[2].clone()}, copies)
    d = diff(read_checkpoint(views), read_checkpoint(copies))
    assert not d.changed and len(d.compared) == 4
    assert [(t.names, t.broken, t.views) for t in d.ties] == [(("base", "col", "row", "t"), True, True)]
    assert "! storage sharing broken: base, col, row, t" in run_cli("diff", str(views), str(copies)).stdout
    edited = {"base": base.clone(), "col": base[:, 1].clone() + 1, "t": base.t().contiguous(), "row": base[2].clone()}
    torch.save(edited, copies)
    d = diff(read_checkpoint(views), read_checkpoint(copies))
    assert [(c.name, c.values and c.values.max_abs_diff) for c in d.changed] == [("col", 1.0)]


def test_across_formats_and_legacy(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in _state().items()}
    pt, st, legacy = tmp_path / "m.pt", tmp_path / "m.safetensors", tmp_path / "legacy.pt"
    torch.save(state, pt)
    save_file(state, st)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert run_cli("diff", str(pt), str(st)).returncode == 0
    assert run_cli("diff", str(legacy), str(st)).returncode == 0
    state["norm.bias"] = state["norm.bias"] + 1
    save_file(state, st)
    proc = run_cli("diff", str(legacy), str(st))
    assert proc.returncode == 1 and "~ norm.bias  values differ (max abs diff 1)" in proc.stdout


def test_hf_directory(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "st", max_shard_size="20KB")
    plain = tmp_path / "plain.pt"
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, plain)
    assert run_cli("diff", str(tmp_path / "st"), str(plain)).returncode == 0
    bf16 = tmp_path / "bf16"
    convert(tmp_path / "st", "bf16", output=bf16)
    proc = run_cli("diff", str(tmp_path / "st"), str(bf16), "--tolerance", "0.01")
    assert proc.returncode == 1 and "float32 -> bfloat16; values within 0.01" in proc.stdout


def test_no_values_and_misuse(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(3)}, a)
    torch.save({"w": torch.ones(3)}, b)
    proc = run_cli("diff", str(a), str(b), "--no-values")
    assert proc.returncode == 0 and "values not read: --no-values" in proc.stdout and "identical" not in proc.stdout
    assert run_cli("diff", str(a), str(b), "--no-values", "--tolerance", "1").returncode == 2
    assert run_cli("diff", str(a), str(b), "--tolerance", "-1").returncode == 2
    assert run_cli("diff", str(a), str(b), "--tolerance", "nan").returncode == 2
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    proc = run_cli("diff", str(a), str(tmp_path / "junk.pt"))
    assert proc.returncode == 2 and proc.stdout == "" and "junk.pt" in proc.stderr


def test_values_that_cannot_be_compared_are_said_so(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    sparse = torch.eye(3).to_sparse()
    torch.save({"s": sparse, "m": torch.empty(2, device="meta")}, a)
    torch.save({"s": sparse, "m": torch.empty(2, device="meta")}, b)
    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 0
    assert "? s  values not compared: sparse_coo tensor" in proc.stdout and "? m  values not compared: meta tensor" in proc.stdout
    assert "not compared for 2" in proc.stdout.splitlines()[-1] and "identical" not in proc.stdout


def test_nan_and_inf_compare_by_position(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"x": torch.tensor([1.0, float("nan"), float("inf")]), "y": torch.tensor([1.0, 2.0])}, a)
    torch.save({"x": torch.tensor([1.0, float("nan"), float("inf")]).half(), "y": torch.tensor([1.0, float("nan")])}, b)
    d = diff(read_checkpoint(a), read_checkpoint(b), tolerance=0.0)
    x, y = (c for c in d.changed)
    assert x.values is not None and x.values.state == "equal" and x.values.max_abs_diff == 0.0  # only its dtype changed
    assert y.values is not None and y.values.state == "differ" and y.values.max_abs_diff == math.inf


LOW_PRECISION = ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32"]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_decoding_from_bits_is_torchs(dtype: str) -> None:
    t = getattr(torch, dtype)
    itemsize = t.itemsize
    codes = np.arange(1 << 16 if itemsize >= 2 else 256).astype(np.uint16 if itemsize >= 2 else np.uint8)
    if dtype == "complex32":  # every float16 as real part, beside every one as imaginary part
        codes = np.stack([codes, codes[::-1]], 1).reshape(-1)
    raw = torch.from_numpy(codes)
    values = raw.view(t)
    expected = (values.to(torch.complex64) if dtype == "complex32" else values.double()).numpy()
    got = decode(raw.numpy(), dtype)
    assert np.array_equal(got, expected, equal_nan=True)
    if dtype.startswith("float8"):
        assert np.array_equal(minifloat_table(dtype), torch.arange(256, dtype=torch.uint8).view(t).double().numpy(), equal_nan=True)


def test_float8_tolerance(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    x = torch.tensor([0.5, 1.0, -2.0, 448.0])
    torch.save({"w": x.to(torch.float8_e4m3fn)}, a)
    torch.save({"w": (x - torch.tensor([0.0, 0.0, 0.0, 40.0])).to(torch.float8_e4m3fn)}, b)
    assert diff(read_checkpoint(a), read_checkpoint(b), tolerance=32.0).changed == ()
    (c,) = diff(read_checkpoint(a), read_checkpoint(b), tolerance=1.0).changed
    assert c.values is not None and c.values.max_abs_diff == 32.0  # 408 rounds to 416 in e4m3fn, whose step there is 32
