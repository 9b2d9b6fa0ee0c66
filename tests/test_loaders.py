"""A folder is audited as the loaders that read it build it: every file beside the weights is read for safety.

Fixtures are written by the real writers (save_pretrained, the Trainer, torch.save, dcp.save); what torch and
from_pretrained load is compared with what dtypeaudit reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.pipeline import expand, scan

from .helpers import json_report, run_cli

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs transformers and accelerate",
)


class Payload:
    """Pickles as a call to os.system (posix.system): what a hostile file beside the weights carries. Never loaded."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.canary}",))


def _hf_folder(path: Path) -> Path:
    """A minimal from_pretrained folder: config.json and model.safetensors in fp16."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "torch_dtype": "float16"}))
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(path / "model.safetensors"))
    return path


def _unsafe(inv: Any) -> list[tuple[str | None, str]]:
    return [(f.file, f.message) for f in inv.findings if f.rule == "unsafe-global"]


# -- every file in a model folder is read for safety ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "sub/extra", "notes.bin"])
def test_an_unsafe_file_beside_the_weights_fails_the_folder(tmp_path: Path, name: str) -> None:
    path = _hf_folder(tmp_path / "m")
    canary = tmp_path / "canary"
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": Payload(canary)}, path / name)
    inv = read_checkpoint(path)
    assert [t.name for t in inv.tensors] == ["w"]  # the dtype audit follows from_pretrained
    assert _unsafe(inv) and _unsafe(inv)[0][0] == name and "posix.system" in _unsafe(inv)[0][1]
    code, doc, _ = json_report("scan", str(path))
    assert code == 1
    assert any(f["rule"] == "unsafe-global" and f["file"] == name for f in doc["checkpoints"][0]["findings"])
    assert not canary.exists()


def test_exclude_leaves_a_file_out_and_says_so(tmp_path: Path) -> None:
    path = _hf_folder(tmp_path / "m")
    torch.save({"args": Payload(tmp_path / "canary")}, path / "training_args.bin")
    (path / "README.md").write_text("# a model\n")
    (path / "notes.txt").write_text("trained on a Tuesday\n")
    code, doc, _ = json_report("scan", str(path), "--exclude", "training_args.bin")
    assert code == 0
    notes = [f for f in doc["checkpoints"][0]["findings"] if f["rule"] == "left-out"]
    assert len(notes) == 1 and "training_args.bin (--exclude training_args.bin)" in notes[0]["message"]
    assert "notes.txt (not a pickle" in notes[0]["message"]  # nothing unusual is left out without being named
    assert "README.md" not in notes[0]["message"]  # a model folder's usual files are read, and no news
    assert "config.json" not in notes[0]["message"]  # from_pretrained reads it: not left out


@needs_transformers
def test_a_trainers_training_args_fails_in_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    """A Trainer's training_args.bin pickles TrainingArguments and its enums, which weights_only refuses: the
    folder fails, as the loader would; the report folds the globals into one line naming the file, and says
    that --exclude leaves it out (the loader does not read it), which then passes."""
    import transformers

    path = _hf_folder(tmp_path / "m")
    torch.save(transformers.TrainingArguments(output_dir=str(tmp_path / "out")), path / "training_args.bin")
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, it refuses
        torch.load(path / "training_args.bin", weights_only=True)
    proc = run_cli("scan", str(path), "-f", "plain")
    assert proc.returncode == 1
    lines = [line for line in proc.stdout.splitlines() if "unsafe-global" in line]
    assert len(lines) == 1 and "unsafe-global ×" in lines[0] and "training_args.bin: calls each of these" in proc.stdout
    assert "transformers.training_args." in proc.stdout  # the globals are the subjects, in the where column
    code, doc, _ = json_report("scan", str(path))
    found = [f for f in doc["checkpoints"][0]["findings"] if f["rule"] == "unsafe-global"]
    assert code == 1 and found and all(f["file"] == "training_args.bin" for f in found)
    assert all(f["message"].endswith("--exclude training_args.bin leaves it out, if you trust where it came from") for f in found)
    assert run_cli("scan", str(path), "--exclude", "training_args.bin").returncode == 0


def test_an_unreadable_file_beside_the_weights_refuses_the_folder(tmp_path: Path) -> None:
    path = _hf_folder(tmp_path / "m")
    (path / "optimizer.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: .*read for safety, so the folder is refused"):
        read_checkpoint(path)
    assert read_checkpoint(path, exclude=("optimizer.pt",)).tensors  # an explicit rule leaves it out


def test_a_link_out_of_the_folder_is_read_where_it_leads(tmp_path: Path) -> None:
    """torch.load follows the link: so does the safety scan, with a note naming where it led."""
    path = _hf_folder(tmp_path / "m")
    outside = tmp_path / "elsewhere.bin"
    torch.save(Payload(tmp_path / "canary"), outside)
    (path / "rng_state.pth").symlink_to(outside)
    inv = read_checkpoint(path)
    assert _unsafe(inv)[0][0] == "rng_state.pth"
    notes = [f.message for f in inv.findings if f.rule == "followed-link"]
    assert notes == [f"rng_state.pth is a link out of the folder, to {outside}; it was read there"]
    # a walk reads it too
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.pt").symlink_to(outside)
    assert [Path(p).name for p in expand([str(plain)])] == ["x.pt"]


def test_a_folder_that_is_dcp_and_hugging_face_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "m"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(path))
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="both a torch.distributed.checkpoint"):
        read_checkpoint(path)
    inv = read_checkpoint(path, exclude=(".metadata",))
    assert inv.format == "hf-directory" and [t.dtype for t in inv.tensors] == ["float16"]


# -- plain folders: nothing skipped silently ----------------------------------------------------------------------


def test_a_zip_torchs_reader_finds_a_pickle_in_is_scanned(tmp_path: Path) -> None:
    """The walk asks torch's reader (as ziparchive mirrors it), not Python's zipfile, whether a zip holds a pickle:
    a record that opens with PROTO is one a loader may unpickle, whatever its name."""
    import zipfile

    root = tmp_path / "tree"
    root.mkdir()
    with zipfile.ZipFile(root / "bundle", "w") as z:
        z.writestr("x/version", "3\n")
        z.writestr("x/state", b"\x80\x02}q\x00.")
    left: list[tuple[str, str]] = []
    assert [Path(p).name for p in expand([str(root)], left_out=left)] == ["bundle"]
    assert left == []


def test_a_legacy_file_with_an_unusual_protocol_is_not_skipped(tmp_path: Path) -> None:
    """torch.load's weights_only unpickler accepts any PROTO number (with a warning): such a file is read or refused,
    never passed over by a walk."""
    root = tmp_path / "tree"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, root / "old", _use_new_zipfile_serialization=False)
    data = bytearray((root / "old").read_bytes())
    assert data[:2] == b"\x80\x02"
    data[1] = 6
    (root / "old").write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(root / "old", weights_only=True)
    assert loaded["w"].dtype == torch.float32  # torch.load loads it
    assert [Path(p).name for p in expand([str(root)])] == ["old"]
    (checkpoint,) = scan([str(root)], jobs=1).checkpoints
    # refused with a reason (a pickle protocol Python's pickle does not know), never left out unread
    assert checkpoint.inventory is None and checkpoint.error is not None
    assert checkpoint.error.startswith(f"{root / 'old'}: ") and "is not a checkpoint" in checkpoint.error


def test_a_walk_lists_what_it_leaves_out(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, root / "weights")
    (root / "readme.md").write_text("# model\n")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    code, doc, _ = json_report("scan", str(root), "--exclude", "weights2*")
    assert code == 0
    notes = [f["message"] for c in doc["checkpoints"] for f in c["findings"] if f["rule"] == "left-out"]
    assert len(notes) == 1 and "dangling (a dangling link)" in notes[0] and "readme.md (not a pickle" in notes[0]


# -- DCP bytes items -----------------------------------------------------------------------------------------------


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Every tensor in a loaded object by dotted path (dict keys, sequence indices, attributes), with its dtype."""
    if isinstance(value, torch.Tensor):
        return {prefix: str(value.dtype)[6:]}
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else vars(value).items()
        if hasattr(value, "__dict__")
        else ()
    )
    out: dict[str, str] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def test_dcp_bytes_items_list_their_tensors_and_name_their_globals(tmp_path: Path) -> None:
    """A tuple or a Namespace is no container DCP flattens: it is saved as a bytes item (a whole torch.save), and
    dcp_to_torch_save loads it with weights_only=False; its tensors are the loaded model's too."""
    import argparse

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "ckpt"
    state = {
        "w": torch.ones(3, dtype=torch.float16),
        "extra": {"t": torch.zeros(2, dtype=torch.float64), "step": 7},
        "pair": (torch.zeros(1, dtype=torch.bfloat16), 3),
        "ns": argparse.Namespace(t=torch.zeros(2, dtype=torch.int8)),
    }
    dcp.save(state, checkpoint_id=str(path))
    dcp_to_torch_save(str(path), str(tmp_path / "flat.pt"))
    loaded = _flatten(torch.load(tmp_path / "flat.pt", weights_only=False))  # our own file, written just now
    assert loaded == {"w": "float16", "extra.t": "float64", "pair.0": "bfloat16", "ns.t": "int8"}
    inv = read_checkpoint(path)
    assert {t.name: t.dtype for t in inv.tensors} == loaded
    assert [(f.rule, f.message.split(":")[0]) for f in inv.findings] == [("foreign-global", "bytes item 'ns'")]


def test_a_dcp_bytes_item_carrying_a_payload_fails(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    canary = tmp_path / "canary"
    dcp.save({"w": torch.ones(3), "cmd": Payload(canary)}, checkpoint_id=str(path))
    inv = read_checkpoint(path)
    unsafe = _unsafe(inv)
    assert unsafe and "bytes item 'cmd'" in unsafe[0][1] and "posix.system" in unsafe[0][1]
    code, _, _ = json_report("scan", str(path))
    assert code == 1 and not canary.exists()


def test_an_unsafe_file_beside_a_dcp_checkpoint_fails_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path))
    torch.save(Payload(tmp_path / "canary"), path / "train_state.pt")
    inv = read_checkpoint(path)
    assert _unsafe(inv)[0][0] == "train_state.pt"


# -- a real Trainer checkpoint -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(8) + i) % 64
            return {"input_ids": ids, "labels": ids}

    out = tmp_path_factory.mktemp("trainer")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=4,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=Tokens()).train()
    return out / "checkpoint-2"


@pytest.mark.slow
@needs_transformers
def test_a_trainer_checkpoint_reads_every_file(trainer_checkpoint: Path) -> None:
    """Every file the Trainer wrote is read: the weights for dtypes, the rest for safety. training_args.bin pickles
    TrainingArguments, which torch.load(weights_only=True) refuses: the folder fails, as the loader would."""
    import transformers

    path = trainer_checkpoint
    names = sorted(p.name for p in path.iterdir())
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "model.safetensors"} <= set(names)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, it refuses
        torch.load(path / "training_args.bin", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    inv = read_checkpoint(path)
    assert {t.name: t.dtype for t in inv.tensors} == {
        k: str(v.dtype)[6:] for k, v in model.state_dict().items() if k in {t.name for t in inv.tensors}
    }
    by_file: dict[str, set[str]] = {}
    for f in inv.findings:
        by_file.setdefault(f.file or "", set()).add(f.rule)
    assert "unsafe-global" in by_file["training_args.bin"]
    assert not [f for f in inv.findings if f.rule == "unused-weights"]  # training state, not weights nobody loads
    assert "unsafe-global" not in by_file.get("optimizer.pt", set()) | by_file.get("scheduler.pt", set())
    (state,) = [f.message for f in inv.findings if f.rule == "training-state"]
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert name in state
    assert not [f for f in inv.findings if f.rule == "left-out"]  # config.json is read, the others are usual files
    # excluding training_args.bin, the rest is safe to load with weights_only=True, and passes
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.load(path / name, weights_only=True)
    clean = read_checkpoint(path, exclude=("training_args.bin",))
    assert not [f for f in clean.findings if f.severity == "error"]


@pytest.mark.slow
@needs_transformers
def test_a_trainer_checkpoint_with_a_payload_in_training_args_fails(trainer_checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_checkpoint, path)
    canary = tmp_path / "canary"
    torch.save(Payload(canary), path / "training_args.bin")
    code, doc, _ = json_report("scan", str(path), "--preset", "fp32")
    assert code == 1
    found = [f for f in doc["checkpoints"][0]["findings"] if f["rule"] == "unsafe-global"]
    assert found and all(f["file"] == "training_args.bin" for f in found) and "posix.system" in found[0]["message"]
    assert not canary.exists()


# -- storage identity ----------------------------------------------------------------------------------------------


def _storage_record(key: bytes, cls: str, numel: int) -> bytes:
    """A storage record whose key is already assembled (an int key or a text key)."""
    from .hostile import global_op, text
    from .pickles import integer, tup

    return tup(text("storage"), global_op("torch", cls), key, text("cpu"), integer(numel)) + b"Q"


def test_storages_with_equal_records_are_two_storages(tmp_path: Path) -> None:
    """Keys 0 and "0" name one record but two storages to torch (its cache is keyed by the key): used as dict keys
    they are two entries, and the tensor stored under each is one the loader returns."""
    from .hostile import text, with_data_pkl
    from .pickles import dictionary, integer, pickle2, storage, tensor

    body = dictionary(
        (
            text("by_storage"),
            dictionary(
                (_storage_record(integer(0), "FloatStorage", 4), tensor(storage("1", "FloatStorage", 2), (2,))),
                (_storage_record(text("0"), "FloatStorage", 4), tensor(storage("2", "HalfStorage", 2), (2,))),
            ),
        )
    )
    path = with_data_pkl(tmp_path / "k.pt", pickle2(body), storages={"0": bytes(16), "1": bytes(8), "2": bytes(4)})
    loaded = torch.load(path, weights_only=True)
    values = sorted(str(v.dtype)[6:] for v in loaded["by_storage"].values())
    keys = [type(k).__name__ for k in loaded["by_storage"]]
    assert values == ["float16", "float32"] and len(keys) == 2
    inv = read_checkpoint(path)
    tensors = {t.name: t for t in inv.tensors}
    assert sorted(t.dtype for n, t in tensors.items() if t.layout == "strided") == values
    storages = [t for t in inv.tensors if t.layout == "storage"]
    assert len(storages) == 2 and {t.dtype for t in storages} == {"float32"}  # the keys, listed as the storages they are


def test_a_bare_storage_is_listed(tmp_path: Path) -> None:
    """torch.save of a storage: torch.load returns a TypedStorage, which the inventory lists, dtype and size."""
    path = tmp_path / "s.pt"
    torch.save({"w": torch.ones(3, dtype=torch.float16), "raw": torch.ones(5, dtype=torch.float64).untyped_storage()}, path)
    loaded = torch.load(path, weights_only=True)
    assert isinstance(loaded["raw"], (torch.UntypedStorage, torch.TypedStorage))
    inv = read_checkpoint(path)
    raw = next(t for t in inv.tensors if t.name == "raw")
    assert raw.layout == "storage" and raw.nbytes == 40
    typed_path = tmp_path / "typed.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"t": torch.ones(4, dtype=torch.float64).storage()}, typed_path)  # a TypedStorage, as old code saves
    typed = torch.load(typed_path, weights_only=True)["t"]
    got = next(t for t in read_checkpoint(typed_path).tensors if t.name == "t")
    assert (got.dtype, got.shape, got.layout) == (str(typed.dtype)[6:], (4,), "storage")


# -- what the full loaders build ----------------------------------------------------------------------------------


def test_backward_hooks_carrying_a_tensor_are_listed(tmp_path: Path) -> None:
    """_rebuild_tensor_v2 sets tensor._backward_hooks to its sixth argument: a tensor inside is one the loader builds."""
    from .hostile import call, global_op, text, with_data_pkl
    from .pickles import FALSE, dictionary, integer, ints, pickle2, storage, tensor

    hooks = call(global_op("collections", "OrderedDict")) + b"(" + text("h") + tensor(storage("1", "DoubleStorage", 3), (3,)) + b"u"
    w = call(
        global_op("torch._utils", "_rebuild_tensor_v2"), storage("0", "HalfStorage", 2), integer(0), ints((2,)), ints((1,)), FALSE, hooks
    )
    path = with_data_pkl(tmp_path / "h.pt", pickle2(dictionary((text("w"), w))), storages={"0": bytes(4), "1": bytes(24)})
    loaded = torch.load(path, weights_only=True)
    assert loaded["w"]._backward_hooks["h"].dtype == torch.float64
    got = {t.name: t.dtype for t in read_checkpoint(path).tensors}
    assert got == {"w": "float16", "w._backward_hooks.h": "float64"}


def test_a_state_shadowing_half_fails_the_scan_and_convert_refuses(tmp_path: Path) -> None:
    """A Parameter whose pickled state sets `half`: the loaded parameter's .half() is not torch's; scan fails it and
    convert does not write it again."""
    from dtypeaudit.conversion import convert
    from dtypeaudit.errors import DtypeAuditError

    p = torch.nn.Parameter(torch.ones(2))
    p.half = 5  # type: ignore[assignment,method-assign]
    path = tmp_path / "p.pt"
    torch.save({"p": p}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["p"].half == 5  # the loaded tensor's .half is not a method
    inv = read_checkpoint(path)
    shadowed = [f for f in inv.findings if f.rule == "shadowed-method"]
    assert len(shadowed) == 1 and shadowed[0].severity == "error" and shadowed[0].tensor == "p" and "half" in shadowed[0].message
    out = tmp_path / "out.pt"
    try:
        result = convert(path, "fp16", output=out)
        assert result.output is None
    except DtypeAuditError:
        pass
    assert not out.exists()


def test_a_divergence_of_the_loaders_is_a_warning_and_fails_strict(tmp_path: Path) -> None:
    """torch.load(weights_only=True) refuses a protocol-4 pickle's opcodes; weights_only=False loads it: a warning that
    names the divergence, an error under --strict."""
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    try:
        torch.load(path, weights_only=True)
        pytest.skip("this torch's weights_only loader reads protocol 4")
    except Exception:
        pass
    notes = [f for f in read_checkpoint(path).findings if f.rule == "loader-divergence"]
    assert len(notes) == 1 and notes[0].severity == "warning" and "weights_only=True" in notes[0].message
    assert json_report("scan", str(path))[0] == 0
    code, doc, _ = json_report("scan", str(path), "--strict")
    assert code == 1 and any(f["rule"] == "loader-divergence" and f["severity"] == "error" for f in doc["checkpoints"][0]["findings"])
