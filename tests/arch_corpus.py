"""Architectures beyond the runtime-truth zoo (issue 19 item 2), each tiny enough to run for real on CPU, and the
dtype mixes users leave them in. Importable on its own (no relative imports), so ``--model
tests/arch_corpus.py:bert`` builds them too. transformers models are built from tiny configs, offline.

Each architecture knows its real inputs (for the CPU forward) and the same inputs as ``trace --input`` specs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# -- plain-torch models ------------------------------------------------------------------------------------


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // 2, 1)
        self.fc2 = nn.Conv2d(channels // 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's / EfficientNet's MBConv: expand 1x1, depthwise 3x3, squeeze-excite, project 1x1."""

    def __init__(self, cin: int, cout: int, expand: int = 2, act: type[nn.Module] = nn.Hardswish) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), act())
        self.depthwise = nn.Sequential(nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False), nn.BatchNorm2d(mid), act())
        self.se = SqueezeExcite(mid)
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class MobileNetish(nn.Module):
    def __init__(self, act: type[nn.Module] = nn.Hardswish) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), act())
        self.blocks = nn.Sequential(InvertedResidual(8, 8, act=act), InvertedResidual(8, 16, act=act))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ConvGroupNorm(nn.Module):
    """A 1-d audio-style encoder: Conv1d + GroupNorm + GELU, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 8, 5, stride=2)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv1d(8, 8, 3)
        self.norm2 = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.norm1(self.conv1(x)))
        x = torch.nn.functional.gelu(self.norm2(self.conv2(x)))
        return self.fc(x.mean(-1))


class LSTMTagger(nn.Module):
    def __init__(self, cell: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = cell(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.rnn(self.embed(ids))[0]
        return self.fc(out)


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids))


class AttentionClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(self.embed(ids)))


class RMSNorm(nn.Module):
    """A user's own RMSNorm, named like torch.nn.RMSNorm but multiplying in its weight's dtype (weight * x)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class RMSNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.norm = RMSNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(self.embed(ids)))))


def mobilenet() -> nn.Module:
    return MobileNetish()


def efficientnet() -> nn.Module:
    return MobileNetish(act=nn.SiLU)


def conv_groupnorm() -> nn.Module:
    return ConvGroupNorm()


def lstm() -> nn.Module:
    return LSTMTagger()


def gru() -> nn.Module:
    return LSTMTagger(nn.GRU)


def embedding_bag() -> nn.Module:
    return BagClassifier()


def multihead_attention() -> nn.Module:
    return AttentionClassifier()


def encoder_layer() -> nn.Module:
    return EncoderClassifier()


def custom_rmsnorm() -> nn.Module:
    return RMSNormMLP()


# -- transformers models, tiny configs -------------------------------------------------------------------------


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


_SMALL = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def bert() -> nn.Module:
    tf = _tf()
    return tf.BertModel(tf.BertConfig(vocab_size=32, max_position_embeddings=16, **_SMALL), add_pooling_layer=False)


def t5() -> nn.Module:
    tf = _tf()
    config = tf.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    return tf.T5EncoderModel(config)


def llama() -> nn.Module:
    tf = _tf()
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, num_key_value_heads=2, max_position_embeddings=16, **_SMALL))


def mistral() -> nn.Module:
    tf = _tf()
    return tf.MistralForCausalLM(tf.MistralConfig(vocab_size=32, num_key_value_heads=1, max_position_embeddings=16, **_SMALL))


def gpt_neox() -> nn.Module:
    tf = _tf()
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=32, max_position_embeddings=16, **_SMALL))


def vit() -> nn.Module:
    tf = _tf()
    return tf.ViTModel(tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, **_SMALL), add_pooling_layer=False)


def whisper() -> nn.Module:
    tf = _tf()
    config = tf.WhisperConfig(
        vocab_size=32,
        num_mel_bins=4,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=4,
        max_target_positions=8,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return tf.WhisperModel(config)


def clip() -> nn.Module:
    tf = _tf()
    text = {"vocab_size": 32, "max_position_embeddings": 8, **_SMALL}
    vision = {"image_size": 8, "patch_size": 4, **_SMALL}
    return tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


# -- how each is fed ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    make: Callable[[], nn.Module]
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    """``(keyword or "", shape, "float" or "int")``: float inputs take the dtype of the model's first layer."""
    source: str = "factory"
    """``transformers`` for a transformers model (trace feeds it as one)."""

    def real_inputs(self, dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        gen = torch.Generator().manual_seed(0)
        for name, shape, kind in self.inputs:
            value = torch.randint(1, 8, shape, generator=gen) if kind == "int" else torch.randn(shape, generator=gen).to(dtype)
            if name:
                kwargs[name] = value
            else:
                args.append(value)
        return tuple(args), kwargs

    def specs(self, dtype: torch.dtype) -> list[str]:
        """The same inputs as ``trace --input`` specs."""
        name_of = str(dtype).removeprefix("torch.")
        out = []
        for name, shape, kind in self.inputs:
            text = "x".join(map(str, shape)) + (":int64" if kind == "int" else f":{name_of}")
            out.append(f"{name}={text}" if name else text)
        return out


IDS = (("input_ids", (1, 5), "int"),)
ARCHS: dict[str, Arch] = {
    "bert": Arch(bert, IDS, "transformers"),
    "t5": Arch(t5, IDS, "transformers"),
    "llama": Arch(llama, IDS, "transformers"),
    "mistral": Arch(mistral, IDS, "transformers"),
    "gpt_neox": Arch(gpt_neox, IDS, "transformers"),
    "vit": Arch(vit, (("pixel_values", (1, 3, 8, 8), "float"),), "transformers"),
    "whisper": Arch(whisper, (("input_features", (1, 4, 8), "float"), ("decoder_input_ids", (1, 3), "int")), "transformers"),
    "clip": Arch(clip, (("input_ids", (1, 5), "int"), ("pixel_values", (1, 3, 8, 8), "float")), "transformers"),
    "mobilenet": Arch(mobilenet, (("", (1, 3, 16, 16), "float"),)),
    "efficientnet": Arch(efficientnet, (("", (1, 3, 16, 16), "float"),)),
    "conv_groupnorm": Arch(conv_groupnorm, (("", (2, 2, 16), "float"),)),
    "lstm": Arch(lstm, (("", (2, 5), "int"),)),
    "gru": Arch(gru, (("", (2, 5), "int"),)),
    "embedding_bag": Arch(embedding_bag, (("", (2, 5), "int"),)),
    "multihead_attention": Arch(multihead_attention, (("", (2, 5), "int"),)),
    "encoder_layer": Arch(encoder_layer, (("", (2, 5), "int"),)),
    "custom_rmsnorm": Arch(custom_rmsnorm, (("", (2, 5), "int"),)),
}
