"""Training checkpoints through convert: a real Lightning ``Trainer.fit`` checkpoint (its callback and loop state
stays as stored) and a real transformers ``Trainer`` ``checkpoint-N/`` (weights converted as from_pretrained loads
them, the training state carried unchanged or left out, never an unsafe file carried forward)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers import run_cli
from .lightning_fit import write as lightning_fit

pytestmark = pytest.mark.slow  # a real Trainer.fit each: seconds of training in a child process


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
