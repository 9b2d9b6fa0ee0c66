"""Training checkpoints through convert: a real Lightning ``Trainer.fit`` checkpoint (its callback and loop state
stays as stored) and a real transformers ``Trainer`` ``checkpoint-N/`` (weights converted as from_pretrained loads
them, the training state carried unchanged or left out, never an unsafe file carried forward). The Trainer's
takes a few seconds in this process (two steps of a one-layer llama) and runs by default."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers import run_cli
from .lightning_fit import write as lightning_fit

# -- Lightning ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("lightning")
    ckpt, _ = lightning_fit(tmp_path_factory.mktemp("lightning"))
    return ckpt


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under ``obj``, by its dotted key path."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensors(v, f"{path}.{k}" if path else str(k)))
    return out


@pytest.mark.slow  # one Trainer.fit in a child process, as tests/test_lightning_checkpoints.py
@pytest.mark.parametrize("preset", [None, "bf16"])
def test_lightning_callback_and_loop_state_is_not_cast_with_the_weights(fitted: Path, tmp_path: Path, preset: str | None) -> None:
    """ModelCheckpoint's kth_value (and every tensor under callbacks/loops) keeps its dtype and value; the weights
    are bf16; the output loads with weights_only=True and through LightningModule.load_from_checkpoint. A policy's
    default does not judge the callback's state either, so --preset bf16 passes."""
    out = tmp_path / "out.ckpt"
    proc = run_cli("convert", str(fitted), "--to", "bf16", "-o", str(out), *(["--preset", preset] if preset else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    source = torch.load(fitted, weights_only=True)
    converted = torch.load(out, weights_only=True)
    state = {k: v for k, v in _tensors(source).items() if k.startswith(("callbacks.", "loops."))}
    assert any(k.endswith(".kth_value") for k in state), sorted(state)  # a real callback tensor is under test
    after = _tensors(converted)
    for name, tensor in state.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    kth = next(v for k, v in after.items() if k.endswith(".kth_value"))
    assert kth.dtype == torch.float32 and math.isinf(kth.item())
    for name, tensor in source["state_dict"].items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert converted["state_dict"][name].dtype == want.dtype and torch.equal(converted["state_dict"][name], want), name
    assert (
        "training state (callbacks, loops, schedulers) is left as stored"
        in run_cli("convert", str(fitted), "--to", "bf16", "--dry-run", "-v").stdout
    )
    # Lightning's own loader reads the output (a module of the same network; its parameters take their own dtypes)
    lit = _lit_class().load_from_checkpoint(out, weights_only=True)
    for name, tensor in lit.state_dict().items():
        assert torch.equal(tensor, converted["state_dict"][name].to(tensor.dtype)), name


def _lit_class() -> Any:
    """The LightningModule tests/lightning_fit.py trains, defined again here to load its checkpoints."""
    import lightning as L
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3).to(torch.bfloat16)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2).to(torch.bfloat16)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

    return Lit


# -- transformers Trainer -------------------------------------------------------------------------------------------

TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) + i) % 64
        return {"input_ids": ids, "labels": ids}


def _trainer(out: Path, max_steps: int) -> Any:
    """A tiny llama's Trainer, saving at step 2 (tests/test_integrations.py's way: CPU, no reports, no bars)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=4,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=_Tokens())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trainer")
    _trainer(out, 2).train()
    path = out / "checkpoint-2"
    assert {"model.safetensors", "training_args.bin", *TRAINING_STATE} <= {p.name for p in path.iterdir()}
    return path


def test_a_trainer_checkpoint_is_refused_in_one_way_that_names_an_option_convert_has(checkpoint: Path, tmp_path: Path) -> None:
    """training_args.bin pickles TrainingArguments (weights_only refuses it): scan fails the folder, so convert refuses
    it (exit 2), writes nothing, and its advice is an option convert takes."""
    out = tmp_path / "out"
    proc = run_cli("convert", str(checkpoint), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not out.exists()
    assert "training_args.bin" in proc.stderr and "--exclude training_args.bin" in proc.stderr
    help_text = run_cli("convert", "--help").stdout
    assert "--exclude GLOB" in help_text


def test_a_trainer_checkpoint_converts_to_a_folder_from_pretrained_loads(checkpoint: Path, tmp_path: Path) -> None:
    """With --exclude training_args.bin: from_pretrained(OUT) equals from_pretrained(checkpoint, dtype=bfloat16) bit for
    bit; the training state is carried byte for byte (optimizer state not cast), training_args.bin is not written,
    the output says which, and Trainer(resume_from_checkpoint=OUT) resumes from it."""
    import transformers

    out = tmp_path / "out"
    proc = run_cli("convert", str(checkpoint), "--to", "bf16", "-o", str(out), "--exclude", "training_args.bin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "carried unchanged: optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json" in proc.stdout
    assert "left out: training_args.bin (--exclude training_args.bin)" in proc.stdout
    assert not (out / "training_args.bin").exists()
    for name in TRAINING_STATE:
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
    optimizer = torch.load(out / "optimizer.pt", weights_only=True)
    assert {v.dtype for s in optimizer["state"].values() for v in s.values()} == {torch.float32}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).state_dict()
    assert loaded.keys() == want.keys()
    for name, tensor in want.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # the Trainer resumes from it: step, optimizer, scheduler and RNG state read back
    trainer = _trainer(tmp_path / "resumed", 3)
    trainer.train(resume_from_checkpoint=str(out))
    assert trainer.state.global_step == 3


def test_a_payload_left_out_by_exclude_is_never_written(checkpoint: Path, tmp_path: Path) -> None:
    """A training_args.bin that calls posix.system, and a file in a subfolder, left out with --exclude: neither is
    read, run or copied into the output."""
    from .test_loaders import Payload

    path = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, path)
    canary = tmp_path / "canary"
    torch.save(Payload(canary), path / "training_args.bin")
    (path / "extra").mkdir()
    torch.save(Payload(canary), path / "extra" / "hook.pt")
    (path / "extra" / "notes.txt").write_text("kept")
    assert run_cli("convert", str(path), "--to", "bf16", "-o", str(tmp_path / "refused")).returncode == 2
    out = tmp_path / "out"
    proc = run_cli("convert", str(path), "--to", "bf16", "-o", str(out), "--exclude", "training_args.bin", "--exclude", "extra/hook.pt")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (out / "training_args.bin").exists() and not (out / "extra" / "hook.pt").exists()
    assert (out / "extra" / "notes.txt").read_text() == "kept"
    assert "extra/hook.pt (--exclude extra/hook.pt)" in proc.stdout
    assert not canary.exists()


def _findings(*args: str) -> tuple[int, list[dict[str, Any]]]:
    proc = run_cli("scan", *args, "-f", "json")
    return proc.returncode, json.loads(proc.stdout)["checkpoints"][0]["findings"]


def test_amp_training_audits_the_trainers_optimizer_state(checkpoint: Path, tmp_path: Path) -> None:
    """optimizer.pt is the optimizer's state, rng_state.pth RNG state (neither "weights from_pretrained would not
    load"); amp-training holds optimizer.pt's moments to fp32: one half exp_avg is an error there, and nothing for a
    half-precision release preset, whose optimizer rule takes any dtype."""
    code, found = _findings(str(checkpoint), "--exclude", "training_args.bin", "--preset", "amp-training")
    assert code == 0, found
    assert not [f for f in found if f["rule"] == "unused-weights"]
    (state,) = [f["message"] for f in found if f["rule"] == "training-state"]
    assert "optimizer.pt (optimizer state: 36 tensors, float32)" in state
    assert "rng_state.pth (the RNG state of python, numpy and torch, no weights)" in state
    path = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, path)
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer["state"][0]["exp_avg"] = optimizer["state"][0]["exp_avg"].half()
    torch.save(optimizer, path / "optimizer.pt")
    code, found = _findings(str(path), "--exclude", "training_args.bin", "--preset", "amp-training")
    (half,) = [f for f in found if f["rule"] == "dtype-mismatch"]
    assert code == 1 and half["file"] == "optimizer.pt" and half["tensor"] == "state.0.exp_avg" and half["actual"] == "float16"
    assert half["severity"] == "error" and "optimizer-state-fp32" in half["message"]
    code, found = _findings(str(path), "--exclude", "training_args.bin", "--preset", "fp16")
    assert not [f for f in found if f.get("file") == "optimizer.pt"]
    # a conversion carries optimizer.pt unchanged, so its planned output fails amp-training the same way
    proc = run_cli(
        "convert", str(path), "--to", "fp32", "-o", str(tmp_path / "out"), "--exclude", "training_args.bin", "--preset", "amp-training"
    )
    assert proc.returncode == 1 and "state.0.exp_avg" in proc.stdout + proc.stderr


def test_exclude_and_in_place_are_refused_together(checkpoint: Path, tmp_path: Path) -> None:
    """The folder that replaces the source holds no excluded file: --in-place would delete them, so it is refused."""
    path = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, path)
    proc = run_cli("convert", str(path), "--to", "bf16", "--in-place", "--exclude", "training_args.bin")
    assert proc.returncode == 2 and "--in-place" in proc.stderr
    assert (path / "training_args.bin").read_bytes() == (checkpoint / "training_args.bin").read_bytes()
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in checkpoint.iterdir())


def test_a_dequantizing_conversion_does_not_write_what_exclude_left_out(tmp_path: Path) -> None:
    """The dequantizing writer copies the folder's other files through the same helper: a payload --exclude names
    is not read, not run and not copied there either."""
    pytest.importorskip("transformers")
    from .test_loaders import Payload
    from .test_quant_convert import make_fp8_dir

    path = make_fp8_dir(tmp_path)
    canary = tmp_path / "canary"
    torch.save(Payload(canary), path / "training_args.bin")
    (path / "notes.txt").write_text("kept")
    out = tmp_path / "out"
    assert run_cli("convert", str(path), "--to", "bf16", "-o", str(out)).returncode == 2
    proc = run_cli("convert", str(path), "--to", "bf16", "-o", str(out), "--exclude", "training_args.bin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (out / "training_args.bin").exists() and (out / "notes.txt").read_text() == "kept"
    assert not canary.exists()
