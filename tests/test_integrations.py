"""The training-loop callbacks in real runs (Lightning, transformers' Trainer) and the pytest plugin under pytester."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtypeaudit.live import AuditFailed

pytest_plugins = ["pytester"]

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs transformers and accelerate",
)


def test_importing_the_integrations_loads_no_framework() -> None:
    """Each integration imports its framework when its class is first asked for, not before."""
    code = (
        "import sys, dtypeaudit, dtypeaudit.live, dtypeaudit.hardware, dtypeaudit.lightning, dtypeaudit.transformers, "
        "dtypeaudit.pytest_plugin\n"
        "print(sorted(m for m in ('torch', 'yaml', 'lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- Lightning ------------------------------------------------------------------------------------------------------


def _lit_module(base: Any, *, targets_dtype: torch.dtype = torch.float32) -> Any:
    class Regressor(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 1))
            self.register_buffer("ema", torch.zeros(1))  # not used by the forward pass

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y.to(x.dtype))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(16, 4, generator=g)
            ds = torch.utils.data.TensorDataset(x if targets_dtype != torch.float64 else x.double(), torch.randn(16, 1, generator=g))
            return torch.utils.data.DataLoader(ds, batch_size=4)

    return Regressor()


class CastAtEpochEnd:
    """A callback that applies ``fn`` to the module at the end of epoch 0: a half-applied cast between epochs."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 0:
            self.fn(pl_module)


def _fit(package: str, callbacks: list[Any], *, epochs: int = 1, module: Any = None) -> Any:
    pl = pytest.importorskip(package)
    base_callback = pl.Callback
    callbacks = [type("Cast", (CastAtEpochEnd, base_callback), {})(c.fn) if isinstance(c, CastAtEpochEnd) else c for c in callbacks]
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module if module is not None else _lit_module(pl.LightningModule))
    return trainer


@needs_lightning
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_fit_passes_when_clean(package: str) -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    cb = DtypeAuditCallback(policy="fp32", when="epoch")
    trainer = _fit(package, [cb], epochs=2)
    assert trainer.current_epoch == 2
    assert [label for label, _ in cb.history] == ["fit start", "the first batch", "the end of epoch 0", "the end of epoch 1"]
    assert cb.findings == []
    names = set(cb.auditor.previous.dtypes)
    assert "net.0.weight" in names and "optimizer.state.net.0.weight.exp_avg" in names


@needs_lightning
def test_lightning_fit_stops_on_a_policy_violation() -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    with pytest.raises(AuditFailed) as info:
        _fit("lightning.pytorch", [DtypeAuditCallback(policy="bf16")])
    text = str(info.value)
    assert text.startswith("dtypeaudit: fit start") and "dtype-mismatch" in text and "expected bfloat16" in text
    assert {f.tensor for f in info.value.findings} >= {"net.0.weight", "net.3.bias"}


@needs_lightning
def test_lightning_drift_between_epochs_stops_the_run() -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    cb = DtypeAuditCallback(when="epoch", drift_severity="error")
    cast = CastAtEpochEnd(lambda m: m.net[3].to(torch.float16))
    with pytest.raises(AuditFailed) as info:
        _fit("lightning.pytorch", [cast, cb], epochs=3)
    drift = [f for f in info.value.findings if f.rule == "dtype-drift"]
    assert {f.tensor for f in drift} == {"net.3.weight", "net.3.bias"}
    assert all("since the end of epoch" not in f.message and "since fit start" in f.message for f in drift)
    assert str(info.value).startswith("dtypeaudit: the end of epoch 0")


@needs_lightning
def test_lightning_warns_instead_of_stopping(caplog: pytest.LogCaptureFixture) -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    cb = DtypeAuditCallback(when="epoch", on_failure="warn", fail_on="warning")
    cast = CastAtEpochEnd(lambda m: setattr(m, "ema", m.ema.double()))
    with caplog.at_level(logging.INFO, logger="dtypeaudit"):
        trainer = _fit("lightning.pytorch", [cast, cb], epochs=2)
    assert trainer.current_epoch == 2  # the run went on
    warned = [r for r in caplog.records if r.name == "dtypeaudit" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "dtype-drift" in warned[0].getMessage() and "ema" in warned[0].getMessage()


@needs_lightning
def test_lightning_audits_every_n_steps() -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    cb = DtypeAuditCallback(when="step:2")
    _fit("lightning.pytorch", [cb], epochs=2)  # 4 steps an epoch
    assert [label for label, _ in cb.history] == ["fit start", "the first batch", "step 2", "step 4", "step 6", "step 8"]


@needs_lightning
def test_lightning_first_batch_against_the_first_layer() -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    pl = pytest.importorskip("lightning.pytorch")
    cb = DtypeAuditCallback(fail_on="warning")
    with pytest.raises(AuditFailed) as info:
        _fit("lightning.pytorch", [cb], module=_lit_module(pl.LightningModule, targets_dtype=torch.float64))
    assert [(f.rule, f.tensor) for f in info.value.findings] == [("batch-dtype", "batch.0")]
    assert str(info.value).startswith("dtypeaudit: the first batch")


@needs_lightning
def test_lightning_target_at_fit_start() -> None:
    from dtypeaudit.lightning import DtypeAuditCallback

    cb = DtypeAuditCallback(target="mps")
    _fit("lightning.pytorch", [cb])
    assert cb.findings == []
    with pytest.raises(AuditFailed, match="unsupported-dtype"):
        _fit("lightning.pytorch", [DtypeAuditCallback(target="mps")], module=_double_module())


def _double_module() -> Any:
    pl = pytest.importorskip("lightning.pytorch")
    module = _lit_module(pl.LightningModule)
    module.ema = module.ema.double()
    return module


# -- transformers ---------------------------------------------------------------------------------------------------


def _tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) + i) % 64
        return {"input_ids": ids, "labels": ids}


def _train(tmp_path: Path, callbacks: list[Any], *, epochs: int = 1, model: Any = None) -> Any:
    import transformers

    model = model if model is not None else _tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=epochs,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    return trainer


@needs_transformers
def test_transformers_trainer_passes_when_clean(tmp_path: Path) -> None:
    from dtypeaudit.transformers import DtypeAuditCallback

    cb = DtypeAuditCallback(policy="fp32", when="epoch")
    trainer = _train(tmp_path, [cb], epochs=2)
    assert trainer.state.global_step == 4
    assert [label for label, _ in cb.history] == ["train start", "the first batch", "the end of epoch 0", "the end of epoch 1"]
    assert cb.findings == []
    assert cb._hook is None  # the first-batch hook removed itself
    assert "optimizer.state.lm_head.weight.exp_avg" in cb.auditor.previous.dtypes


@needs_transformers
def test_transformers_trainer_stops_on_a_policy_violation(tmp_path: Path) -> None:
    from dtypeaudit.transformers import DtypeAuditCallback

    with pytest.raises(AuditFailed) as info:
        _train(tmp_path, [DtypeAuditCallback(policy="bf16")])
    assert str(info.value).startswith("dtypeaudit: train start")
    assert "model.embed_tokens.weight" in {f.tensor for f in info.value.findings}


@needs_transformers
def test_transformers_drift_between_epochs(tmp_path: Path) -> None:
    import transformers

    from dtypeaudit.transformers import DtypeAuditCallback

    class Cast(transformers.TrainerCallback):
        def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if round(state.epoch) == 1:
                model.lm_head.to(torch.bfloat16)

    with pytest.raises(AuditFailed) as info:
        _train(tmp_path, [Cast(), DtypeAuditCallback(when="epoch", fail_on="warning")], epochs=3)
    drift = [f for f in info.value.findings if f.rule == "dtype-drift"]
    assert [(f.tensor, f.actual) for f in drift] == [("lm_head.weight", "bfloat16")]
    assert "since train start" in drift[0].message


@needs_transformers
def test_transformers_first_batch_is_seen_through_a_forward_hook(tmp_path: Path) -> None:
    from dtypeaudit.transformers import DtypeAuditCallback

    cb = DtypeAuditCallback(policy="fp32", target="cpu")
    _train(tmp_path, [cb])
    labels = [label for label, _ in cb.history]
    assert labels == ["train start", "the first batch"] and cb.findings == []
    with pytest.raises(AuditFailed, match="emulated-dtype"):
        _train(tmp_path, [DtypeAuditCallback(target="cpu", fail_on="warning")], model=_tiny_llama().to(torch.bfloat16))


# -- the pytest plugin ----------------------------------------------------------------------------------------------


def _plugin_args() -> list[str]:
    """The plugin is found through its pytest11 entry point once the package is installed; name it otherwise."""
    names = {ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    return [] if "dtypeaudit.pytest_plugin" in names else ["-p", "dtypeaudit.pytest_plugin"]


def test_plugin_is_registered_through_the_pytest11_entry_point() -> None:
    import tomllib

    from .helpers import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"]["pytest11"] == {"dtypeaudit": "dtypeaudit.pytest_plugin"}


_MODELS = """
import torch
from torch import nn

def build(dtype=torch.float32):
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)
"""


def test_fixture_passes_a_clean_model_and_fails_with_the_table(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=_MODELS)
    pytester.makepyfile(
        test_release="""
import torch
from models import build

def test_clean(dtype_audit):
    assert dtype_audit.assert_clean(build(), policy="fp32") == []

def test_half_model(dtype_audit):
    dtype_audit.assert_clean(build(torch.float16), policy="fp32")

def test_warnings_pass_unless_asked(dtype_audit):
    found = dtype_audit.assert_clean(build(torch.bfloat16), target="t4")
    assert {f.rule for f in found} == {"emulated-dtype"}

def test_fail_on_warning(dtype_audit):
    dtype_audit.assert_clean(build(torch.bfloat16), target="t4", fail_on="warning")
"""
    )
    result = pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*dtype audit of <Sequential> against *fp32.yaml",
            "*severity*rule*where*message*",
            "*error*dtype-mismatch ×6*0.weight*is float16, expected float32*",
            "*6 errors (failing at error)",
        ]
    )
    assert "emulated-dtype" in out and "(failing at warning)" in out
    assert "Traceback" not in out and "pytest_plugin.py" not in out  # the table is the message


def test_fixture_takes_the_projects_default_policy(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(models=_MODELS)
    pytester.makeini("[pytest]\ndtype_audit_policy = bf16\n")
    pytester.makepyfile(
        test_default="""
import torch
from models import build

def test_bf16(dtype_audit):
    dtype_audit.assert_clean(build(torch.bfloat16))

def test_fp32(dtype_audit):
    dtype_audit.assert_clean(build())
"""
    )
    result = pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*is float32, expected bfloat16*"])
