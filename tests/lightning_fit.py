"""A real Lightning ``Trainer.fit`` checkpoint, written in a child process (``python -m tests.lightning_fit DIR``).

Two optimizer steps on CPU with ``ModelCheckpoint``: the file a user gets early in training, with the callback's
``kth_value`` still inf. The LightningModule holds the network as ``net``, so its weights are ``state_dict.net.*``;
``DIR/bare.pt`` is the same network's own ``state_dict()``. The network keeps its convolution and linear layer in
bfloat16 and its BatchNorm in float32, so that a policy written from one file has rules to carry to the other.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .helpers import ROOT


def write(directory: Path) -> tuple[Path, Path]:
    """Run the training in a child process; the checkpoint and the bare state_dict it wrote."""
    subprocess.run([sys.executable, "-m", "tests.lightning_fit", str(directory)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    (ckpt,) = directory.glob("*.ckpt")
    return ckpt, directory / "bare.pt"


def _train(directory: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3).to(torch.bfloat16)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2).to(torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bn(self.conv(x.to(torch.bfloat16)).float())
            return self.fc(h.mean((2, 3)).to(torch.bfloat16)).float()

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,)))
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1)],
        default_root_dir=directory,
    )
    lit = Lit()
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=4))
    torch.save(lit.net.state_dict(), directory / "bare.pt")


if __name__ == "__main__":
    _train(Path(sys.argv[1]))
