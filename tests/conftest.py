"""Checkpoints written at test time by the real writers: torch.save, torch.jit, DCP, safetensors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from .oracle import SAVABLE_DTYPES


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class TinyLM(nn.Module):
    """Transformer-shaped: embeddings tied to the output head, layer norms, repeated blocks."""

    def __init__(self, vocab: int = 32, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "attn": nn.Linear(dim, 3 * dim), "mlp": nn.Linear(dim, dim)}) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer["mlp"](layer["norm"](x))
        return self.lm_head(self.norm(x))


def all_dtypes_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {f"t_{name}": torch.zeros(2, 3, dtype=getattr(torch, name)) for name in SAVABLE_DTYPES}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state["base"] = base
    state["row_view"] = base[2]
    state["col_view"] = base[:, 1]
    state["transposed"] = base.t()
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.empty(0, 5)
    state["param"] = nn.Parameter(torch.ones(3))
    return state


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


class LitModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyCNN()


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


def write_sharded(directory: Path, state: dict[str, torch.Tensor], shards: int, *, kind: str = "safetensors") -> Path:
    """Write ``state`` the way transformers' save_pretrained shards it: numbered shards and an index."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        chunk = {n: state[n].contiguous() for n in names[i * per : (i + 1) * per]}
        if kind == "safetensors":
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(chunk, str(directory / fname), metadata={"format": "pt"})
        else:
            fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            torch.save(chunk, directory / fname)
        for n, t in chunk.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index_name = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (directory / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (directory / "config.json").write_text(json.dumps({"architectures": ["TinyLM"], "torch_dtype": "float32"}))
    return directory


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
