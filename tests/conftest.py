"""Checkpoints written at test time by the real writers: torch.save, torch.jit, DCP, safetensors."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from .helpers import all_dtypes_state, write_sharded
from .models import LitModule, TinyCNN, TinyLM


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def all_dtypes_pt(ckpt_dir: Path) -> Path:
    path = ckpt_dir / "all_dtypes.pt"
    torch.save(all_dtypes_state(), path)
    return path


@pytest.fixture(scope="session")
def tied_lm_pt(ckpt_dir: Path) -> Path:
    path = ckpt_dir / "tied_lm.pth"
    torch.save(TinyLM().state_dict(), path)
    return path


@pytest.fixture(scope="session")
def training_pt(ckpt_dir: Path) -> Path:
    """A plain-PyTorch training checkpoint: model, Adam state after one step, epoch."""
    model = TinyCNN()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    path = ckpt_dir / "training.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    return path


def _attribute_dict_class() -> type:
    """Lightning's AttributeDict, under the module path Lightning pickles it from: the real one where lightning is
    installed (a stand-in in sys.modules would hide the real package from every test after this one)."""
    try:
        import lightning.fabric.utilities.data as real

        return real.AttributeDict  # type: ignore[no-any-return]
    except ImportError:
        pass
    mod = sys.modules.get("lightning.fabric.utilities.data")
    if mod is None:
        for name in ("lightning", "lightning.fabric", "lightning.fabric.utilities", "lightning.fabric.utilities.data"):
            sys.modules.setdefault(name, types.ModuleType(name))
        mod = sys.modules["lightning.fabric.utilities.data"]

        class AttributeDict(dict):  # type: ignore[type-arg]
            def __getattr__(self, key: str) -> object:
                try:
                    return self[key]
                except KeyError:
                    raise AttributeError(key) from None

        AttributeDict.__module__ = mod.__name__
        AttributeDict.__qualname__ = "AttributeDict"
        mod.AttributeDict = AttributeDict  # type: ignore[attr-defined]
    return mod.AttributeDict  # type: ignore[attr-defined,no-any-return]


@pytest.fixture(scope="session")
def lightning_ckpt(ckpt_dir: Path) -> Path:
    """The layout Lightning's trainer.save_checkpoint writes."""
    lit = LitModule()
    opt = torch.optim.AdamW(lit.parameters())
    lit.net(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    hparams = _attribute_dict_class()(lr=1e-3, hidden=4)
    ckpt = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": lit.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": hparams,
    }
    path = ckpt_dir / "epoch=3-step=120.ckpt"
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="session")
def legacy_pt(ckpt_dir: Path) -> Path:
    path = ckpt_dir / "legacy.pt"
    state = {k: v for k, v in all_dtypes_state().items() if not k.startswith(("t_float8", "t_float4", "t_uint", "t_bits", "t_complex32"))}
    torch.save(state, path, _use_new_zipfile_serialization=False)
    return path


class ScriptNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.register_buffer("scale", torch.ones(1, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) * self.scale.float()


@pytest.fixture(scope="session")
def torchscript_pt(ckpt_dir: Path) -> Path:
    path = ckpt_dir / "scripted.pt"
    torch.jit.save(torch.jit.script(ScriptNet()), str(path))
    return path


@pytest.fixture(scope="session")
def safetensors_file(ckpt_dir: Path) -> Path:
    from safetensors.torch import save_file

    path = ckpt_dir / "model.safetensors"
    state = {
        "embed.weight": torch.zeros(16, 4, dtype=torch.bfloat16),
        "norm.weight": torch.ones(4),
        "head.weight": torch.zeros(3, 4, dtype=torch.float16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.zeros(5, dtype=torch.bool),
        "f8": torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
    }
    save_file(state, str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def hf_dir(ckpt_dir: Path) -> Path:
    state = {k: v.clone() for k, v in TinyLM().state_dict().items() if k != "lm_head.weight"}
    return write_sharded(ckpt_dir / "hf-safetensors", state, 3)


@pytest.fixture(scope="session")
def hf_bin_dir(ckpt_dir: Path) -> Path:
    return write_sharded(ckpt_dir / "hf-bin", TinyLM().state_dict(), 2, kind="bin")


@pytest.fixture(scope="session")
def dcp_dir(ckpt_dir: Path) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    path = ckpt_dir / "dcp"
    state = {"model": TinyCNN().half().state_dict(), "step": 5, "extra": {"scale": torch.ones(2, dtype=torch.bfloat16)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    return tmp_path / "canary-created-by-hostile-pickle"
