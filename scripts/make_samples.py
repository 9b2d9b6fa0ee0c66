"""Regenerate the shipped sample checkpoints (a few KB each) with the real writers.

python scripts/make_samples.py   # writes into sample_models/ (only checkpoints live there: a scan of it reads them all)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)


class TinyBlock(nn.Module):
    """One pre-norm transformer block with an embedding tied to the output head."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def build_cnn() -> nn.Module:
    return TinyCNN()


def build_block() -> nn.Module:
    return TinyBlock()


def main() -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    # 1. An fp32 CNN with BatchNorm: the common starting point.
    torch.save(TinyCNN().state_dict(), SAMPLES / "cnn_fp32.pt")

    # 2. A transformer block in bf16 as safetensors, the way hubs ship weights (ties written once).
    block = TinyBlock().to(torch.bfloat16).state_dict()
    save_file(
        {k: v.contiguous() for k, v in block.items() if k != "lm_head.weight"}, str(SAMPLES / "block_bf16.safetensors"), {"format": "pt"}
    )

    # 3. A half-finished fp16 conversion: one bias was left behind in fp32, the classic
    #    "expected scalar type Half but found Float" at the first forward pass.
    half = TinyCNN().half()
    half.fc.bias.data = half.fc.bias.data.float()
    torch.save({"model": half.state_dict(), "epoch": 7}, SAMPLES / "cnn_half_converted.pt")


if __name__ == "__main__":
    main()
