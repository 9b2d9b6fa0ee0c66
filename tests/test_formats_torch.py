"""torch.save archives, legacy files and TorchScript: the inventory equals what torch itself loads."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint

from . import oracle
from .helpers import facts, sharing


def test_every_savable_dtype_matches_torch(all_dtypes_pt: Path) -> None:
    inv = read_checkpoint(all_dtypes_pt)
    expected = oracle.load(all_dtypes_pt)
    assert inv.format == "torch-zip"
    assert facts(inv) == oracle.facts(expected)
    assert [t.name for t in inv.tensors] == list(expected)
    assert sharing(inv) == oracle.sharing(expected)


def test_views_keep_offsets_strides_and_sizes(all_dtypes_pt: Path) -> None:
    by = read_checkpoint(all_dtypes_pt).by_name()
    loaded = oracle.load(all_dtypes_pt)
    for name in ("base", "row_view", "col_view", "transposed", "scalar", "empty"):
        assert by[name].offset == loaded[name].storage_offset()
        assert by[name].stride == loaded[name].stride()
        assert by[name].nbytes == loaded[name].numel() * loaded[name].element_size()
    assert set(by["row_view"].shares_with) == {"base", "col_view", "transposed"}
    assert by["scalar"].shape == () and by["empty"].shape == (0, 5)


def test_tied_weights_are_one_storage(tied_lm_pt: Path) -> None:
    inv = read_checkpoint(tied_lm_pt)
    by = inv.by_name()
    assert by["lm_head.weight"].shares_with == ("embed.weight",)
    assert sharing(inv) == oracle.sharing(oracle.load(tied_lm_pt))


def test_training_checkpoint_names_and_regions(training_pt: Path) -> None:
    inv = read_checkpoint(training_pt)
    assert facts(inv) == oracle.facts(oracle.load(training_pt))
    by = inv.by_name()
    assert by["model.conv.weight"].region == "model"
    assert by["optimizer.state.0.exp_avg"].region == "optimizer"
    assert by["optimizer.state.0.step"].dtype == "float32"
    assert inv.findings == ()


def test_lightning_checkpoint(lightning_ckpt: Path) -> None:
    inv = read_checkpoint(lightning_ckpt)
    names = [t.name for t in inv.tensors]
    assert "state_dict.net.conv.weight" in names
    assert "optimizer_states.0.state.1.exp_avg_sq" in names
    assert inv.by_name()["optimizer_states.0.state.1.exp_avg_sq"].region == "optimizer"
    # The AttributeDict is reported, not loaded, and does not hide the tensors around it.
    assert [(f.rule, f.severity) for f in inv.findings] == [("foreign-global", "warning")]
    assert "lightning.fabric.utilities.data.AttributeDict" in inv.findings[0].message


def test_parameters_are_marked(all_dtypes_pt: Path) -> None:
    by = read_checkpoint(all_dtypes_pt).by_name()
    assert by["param"].kind == "parameter"
    assert by["base"].kind == "unknown"


def test_whole_module_pickle_lists_parameters(tmp_path: Path) -> None:
    # nn.Module pickles reference torch.nn classes: reported as unsafe, yet the tensors are listed.
    path = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 3), path)
    inv = read_checkpoint(path)
    assert {t.name: t.kind for t in inv.tensors} == {"_parameters.weight": "parameter", "_parameters.bias": "parameter"}
    assert any(f.rule == "unsafe-global" and "torch.nn.modules.linear.Linear" in f.message for f in inv.findings)


def test_quantized_sparse_and_meta(tmp_path: Path) -> None:
    path = tmp_path / "exotic.pt"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    torch.save({"q": q, "sp": torch.eye(3).to_sparse(), "meta": torch.empty(3, 4, device="meta")}, path)
    by = read_checkpoint(path).by_name()
    assert (by["q"].dtype, by["q"].layout, by["q"].shape) == ("qint8", "quantized", (4,))
    assert (by["sp"].dtype, by["sp"].layout, by["sp"].shape) == ("float32", "sparse_coo", (3, 3))
    assert (by["meta"].dtype, by["meta"].layout, by["meta"].nbytes) == ("float32", "meta", 0)


def test_extension_does_not_matter(all_dtypes_pt: Path, tmp_path: Path) -> None:
    for ext in (".bin", ".ckpt", ".tar", ".model", ".weights"):
        copy = tmp_path / f"renamed{ext}"
        copy.write_bytes(all_dtypes_pt.read_bytes())
        assert read_checkpoint(copy).format == "torch-zip"


def test_saved_to_a_buffer_prefix(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2, dtype=torch.float16)}, buf)
    path = tmp_path / "buffered.pt"
    path.write_bytes(buf.getvalue())
    inv = read_checkpoint(path)
    assert facts(inv) == {"w": ("float16", (2,), "unknown")}
    assert inv.metadata["archive_prefix"] == "archive"


def test_legacy_format_matches_torch(legacy_pt: Path) -> None:
    inv = read_checkpoint(legacy_pt)
    assert inv.format == "torch-legacy"
    loaded = oracle.load(legacy_pt)
    assert facts(inv) == oracle.facts(loaded)
    assert sharing(inv) == oracle.sharing(loaded)


def test_torchscript_attribute_paths_kinds_and_modules(torchscript_pt: Path) -> None:
    inv = read_checkpoint(torchscript_pt)
    assert inv.format == "torchscript"
    module = torch.jit.load(str(torchscript_pt))
    expected = {n: ("parameter", str(p.dtype)[6:], tuple(p.shape)) for n, p in module.named_parameters()}
    expected |= {n: ("buffer", str(b.dtype)[6:], tuple(b.shape)) for n, b in module.named_buffers()}
    assert {t.name: (t.kind, t.dtype, t.shape) for t in inv.tensors} == expected
    by = inv.by_name()
    assert by["bn.running_mean"].module == "BatchNorm2d"
    assert by["conv.weight"].module == "Conv2d"
    assert by["scale"].module == "ScriptNet"
    # torch.jit.load runs the archive's code and may build other dtypes than listed: a warning (an error under --strict).
    assert [(f.rule, f.severity) for f in inv.findings] == [("loader-divergence", "warning")]


class Boom:
    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {os.environ['DTYPEAUDIT_CANARY']}",))


def test_hostile_reduce_is_reported_and_never_runs(tmp_path: Path, canary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTYPEAUDIT_CANARY", str(canary))
    path = tmp_path / "hostile.pt"
    torch.save({"weight": torch.ones(2), "payload": Boom()}, path)
    inv = read_checkpoint(path)
    assert not canary.exists()
    assert [t.name for t in inv.tensors] == ["weight"]
    (finding,) = inv.findings
    assert finding.rule == "unsafe-global" and finding.severity == "error"
    assert "calls posix.system" in finding.message and "can execute code" in finding.message


def test_bare_pickle_is_read_for_its_globals(tmp_path: Path, canary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTYPEAUDIT_CANARY", str(canary))
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": 1, "boom": Boom()}))
    inv = read_checkpoint(path)
    assert inv.format == "pickle"
    assert not canary.exists()
    assert [f.rule for f in inv.findings] == ["unsafe-global", "loader-divergence"]  # torch.load refuses bare pickles


def test_storage_record_missing_or_short(all_dtypes_pt: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(all_dtypes_pt) as src:
        prefix = next(n for n in src.namelist() if n.endswith("data.pkl"))[: -len("data.pkl")]
        items = [(i, src.read(i)) for i in src.infolist()]
    missing = tmp_path / "missing.pt"
    short = tmp_path / "short.pt"
    # Each archive gets its own ZipInfo objects: writestr records the header offset in the one it is given.
    with zipfile.ZipFile(missing, "w") as a:
        for info, data in items:
            if info.filename != f"{prefix}data/0":
                a.writestr(info.filename, data)
    with zipfile.ZipFile(short, "w") as b:
        for info, data in items:
            b.writestr(info.filename, data[:1] if info.filename == f"{prefix}data/0" else data)
    with pytest.raises(CheckpointError, match="storage '0' is missing"):
        read_checkpoint(missing)
    with pytest.raises(CheckpointError, match="holds 1 bytes but the pickle needs"):
        read_checkpoint(short)
