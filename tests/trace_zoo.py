"""The models of the trace zoo (tests/test_trace_truth.py), each small enough to run for real on CPU, and the
dtype mixes users end up with. Importable on its own (no relative imports), so ``dtypeaudit trace
tests/trace_zoo.py:cnn_forgot_half`` builds them too.

Every builder works on any device, the meta device included: the trace builds on meta, the truth on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class SmallCNN(nn.Module):
    """conv-BN-ReLU twice, a pool and a classifier: the shape of most image models."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Attention(nn.Module):
    """Hand-written causal self-attention: a softmax, a mask, two projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, torch_attention: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn: nn.Module = nn.MultiheadAttention(dim, heads, batch_first=True) if torch_attention else Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            h = self.attn(h, h, h, need_weights=False)[0]
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token and position embeddings, two blocks, a final norm and a head: a GPT in miniature."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, layers: int = 2, context: int = 8, torch_attention: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, torch_attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt2_config() -> Any:
    import transformers

    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)


def gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel._from_config(gpt2_config())


# -- the mixes: (name, how to break the model, input dtype) -----------------------------------------------------------


def _noop(m: nn.Module) -> None:
    return None


def _linears(m: nn.Module) -> list[nn.Linear]:
    return [x for x in m.modules() if isinstance(x, nn.Linear)]


def _fp32_bias(m: nn.Module) -> None:
    """The last layer with a bias keeps it in float32 (GPT-2's layers are transformers' Conv1D, its head has no bias)."""
    m.half()
    layer = [x for x in m.modules() if isinstance(getattr(x, "bias", None), nn.Parameter) and x.weight.dim() == 2][-1]
    layer.bias.data = layer.bias.data.float()


def _half_bn(m: nn.Module) -> None:
    """BatchNorm weights converted, running statistics left in float32 (a half-finished .half())."""
    bn = next(x for x in m.modules() if isinstance(x, nn.BatchNorm2d))
    bn.weight.data = bn.weight.data.half()
    bn.bias.data = bn.bias.data.half()


def _half_bn_stats(m: nn.Module) -> None:
    """The opposite half-conversion: statistics in float16 beside float32 weights."""
    bn = next(x for x in m.modules() if isinstance(x, nn.BatchNorm2d))
    bn.running_mean.data = bn.running_mean.data.half()
    bn.running_var.data = bn.running_var.data.half()


def _head_left_fp32(m: nn.Module) -> None:
    m.half()
    _linears(m)[-1].float()


def _bf16_embedding(m: nn.Module) -> None:
    m.half()
    next(x for x in m.modules() if isinstance(x, nn.Embedding)).bfloat16()


def _fp16_norms_fp32(m: nn.Module) -> None:
    """Working mixed precision: fp16 weights, LayerNorms in float32 (they take half input)."""
    m.half()
    for x in m.modules():
        if isinstance(x, nn.LayerNorm):
            x.float()


Mix = tuple[str, Callable[[nn.Module], None], str]

CNN_MIXES: list[Mix] = [
    ("fp32", _noop, "float32"),
    ("half", lambda m: m.half(), "float16"),
    ("bf16", lambda m: m.bfloat16(), "bfloat16"),
    ("forgot-half-input", lambda m: m.half(), "float32"),
    ("fp32-bias", _fp32_bias, "float16"),
    ("half-bn", _half_bn, "float32"),
    ("half-bn-stats", _half_bn_stats, "float16"),
    ("fp64-layer", _noop, "float32"),  # built with conv2 under set_default_dtype(float64), see cnn()
]

TOKEN_MIXES: list[Mix] = [
    ("fp32", _noop, "int64"),
    ("half", lambda m: m.half(), "int64"),
    ("bf16", lambda m: m.bfloat16(), "int64"),
    ("fp32-bias", _fp32_bias, "int64"),
    ("head-left-fp32", _head_left_fp32, "int64"),
    ("bf16-embedding", _bf16_embedding, "int64"),
    ("fp16-norms-fp32", _fp16_norms_fp32, "int64"),
    ("fp64-layer", _noop, "int64"),  # one block's MLP built under set_default_dtype(float64)
]


def cnn(mix: str = "fp32") -> nn.Module:
    model = SmallCNN()
    if mix == "fp64-layer":
        with default_dtype(torch.float64):
            model.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
    dict((n, f) for n, f, _ in CNN_MIXES)[mix](model)
    return model


def transformer(mix: str = "fp32", torch_attention: bool = False) -> nn.Module:
    model = TinyTransformer(torch_attention=torch_attention)
    if mix == "fp64-layer":
        with default_dtype(torch.float64):
            model.blocks[1].mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    dict((n, f) for n, f, _ in TOKEN_MIXES)[mix](model)
    return model


def gpt2_mixed(mix: str = "fp32") -> nn.Module:
    model = gpt2()
    if mix == "fp64-layer":
        model.transformer.h[1].mlp.double()
    dict((n, f) for n, f, _ in TOKEN_MIXES)[mix](model)
    return model


# Factories for the command line (file.py:func takes no arguments).
def cnn_fp32() -> nn.Module:
    return cnn("fp32")


def cnn_forgot_half() -> nn.Module:
    return cnn("forgot-half-input")


def cnn_fp32_bias() -> nn.Module:
    return cnn("fp32-bias")


def transformer_bf16_embedding() -> nn.Module:
    return transformer("bf16-embedding")


def raises() -> nn.Module:
    raise RuntimeError("the factory could not find its weights")


class DataDependent(nn.Module):
    """Keeps the positive entries: the output's shape depends on the values, which fake tensors do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.select = Select()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.select(self.fc(x))


class Select(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def data_dependent() -> nn.Module:
    return DataDependent()
