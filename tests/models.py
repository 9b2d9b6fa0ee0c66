"""The small models that more than one test file builds, each defined once here.

Plain torch and no relative imports: the model corpora that also run as scripts (``--model
tests/consistency_models.py:resnet``, where only their own folder is on ``sys.path``) import from here too, and a
factory reference names them directly (``--model tests.models:TinyLM``). Corpora with a purpose of their own
(tests/trace_zoo.py, tests/arch_corpus.py, tests/consistency_models.py) keep their other models, and a model that
exists for one test file's point stays in that file.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class TinyCNN(nn.Module):
    """conv, BatchNorm, linear: the smallest image model with a BatchNorm's buffers (tests/conftest.py's checkpoints)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class LitModule(nn.Module):
    """A LightningModule's shape (the network under ``net``): the lightning checkpoint's model, and its ``--model``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyCNN()


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


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-BN-ReLU, conv-BN, plus the input, through a downsample
    ``Sequential(conv, bn)`` where the stride or the width changes (BatchNorms as attributes and inside a Sequential).

    torchvision keeps its ReLU as a submodule (``self.relu``, in place). ``relu_module=False`` calls ``torch.relu``
    instead, for the tests written against a module tree of only the layers that hold tensors; the parameters, their
    order (so their initial values under one seed) and the values computed are the same either way.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, *, relu_module: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        if relu_module:
            self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def _relu(self, x: torch.Tensor) -> torch.Tensor:
        relu = self._modules.get("relu")
        return relu(x) if relu is not None else torch.relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self._relu(self.bn1(self.conv1(x)))
        return self._relu(self.bn2(self.conv2(out)) + identity)


class TwoConvNet(nn.Module):
    """Two convs, a BatchNorm between them and a classifier, no forward: the checkpoint the HTML report tests draw
    (tests/test_render_html.py, tests/test_html_browser.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8, 10)


# -- the runtime-truth corpus (tests/test_runtime_truth.py, tests/test_structure.py) ----------------------------------
# A torchvision-style ResNet with BatchNorms in Sequentials, an MLP, a one-block transformer, transformers' GPT-2 and
# Llama; ``--model tests.models:make_NAME`` builds each.


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8, relu_module=False), BasicBlock(8, 8, relu_module=False))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2, relu_module=False), BasicBlock(16, 16, relu_module=False))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(x.mean((2, 3)))


class OneBlockTransformer(nn.Module):
    """One pre-norm transformer block: token and position embeddings, LayerNorms, attention and an MLP."""

    def __init__(self, vocab: int = 64, dim: int = 16, positions: int = 16) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(positions, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embed(ids) + self.pos_embed(torch.arange(ids.shape[1]))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
        x = x + self.proj(attn)
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.head(self.ln_f(x))


def make_resnet() -> nn.Module:
    return TinyResNet()


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_transformer() -> nn.Module:
    return OneBlockTransformer()


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def make_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))


def make_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, vocab_size=64
    )
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {  # the runtime-truth corpus, by name
    "resnet": make_resnet,
    "mlp": make_mlp,
    "transformer": make_transformer,
    "gpt2": make_gpt2,
    "llama": make_llama,
}
