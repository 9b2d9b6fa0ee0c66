"""The models of the self-consistency matrix (tests/test_convert_consistency.py), importable on their own so
that ``--model tests/consistency_models.py:resnet`` builds them too (no relative imports here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

try:
    from tests.models import BasicBlock
except ImportError:  # run as a script (--model tests/consistency_models.py:resnet): its own folder is on sys.path
    from models import BasicBlock  # type: ignore[no-redef]


class ResNet(nn.Module):
    """torchvision's resnet layout (conv1, bn1, layer1..2 of BasicBlocks, fc), narrow enough to run in milliseconds."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet() -> ResNet:
    return ResNet()


def gpt2_config() -> Any:
    import transformers

    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, eos_token_id=0, bos_token_id=0)


def gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(gpt2_config())


def llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def llama() -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(llama_config())
