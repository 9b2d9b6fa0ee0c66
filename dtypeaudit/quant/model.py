"""What a quantized checkpoint means: logical weights made of storage tensors, each with its scheme.

Frozen dataclasses, no torch: :mod:`.group` builds them from an Inventory (metadata only), checks and
renderers read them, and the dequantizers (``quant/dequant*.py``) take a :class:`LogicalWeight` plus its
storage tensors' bytes and give back the weight in ``dequantizes_to``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# Families: the layout a dequantizer must know. One dequantizer per family (params refine it).
FP8 = "fp8"
"""transformers' ``fp8`` method: float8 weight, ``weight_scale_inv`` per block (or per tensor)."""
COMPRESSED = "compressed-tensors"
"""compressed-tensors ``float-quantized`` / ``int-quantized`` / ``naive-quantized``: weight stored in its
quantized dtype (float8/int8) beside ``weight_scale`` (and ``weight_zero_point``)."""
PACKED = "compressed-tensors-packed"
"""compressed-tensors ``pack-quantized``: int4/int8 values packed into int32 ``weight_packed``."""
NVFP4 = "nvfp4"
"""compressed-tensors ``nvfp4-pack-quantized``: fp4 e2m1 pairs in uint8, fp8 group scales, fp32 global scale."""
MXFP4 = "mxfp4"
"""OCP MX fp4 (gpt-oss): ``*_blocks`` uint8 (two e2m1 per byte), ``*_scales`` uint8 e8m0 exponents per 32."""
GPTQ = "gptq"
"""GPTQ: ``qweight`` int32 packed along the input dim, ``qzeros``, ``scales``, optional ``g_idx``."""
AWQ = "awq"
"""AWQ (GEMM): ``qweight`` int32 packed along the output dim in AWQ's interleaved order, ``qzeros``, ``scales``."""
BNB4 = "bnb-4bit"
"""bitsandbytes 4-bit (nf4/fp4): packed uint8 ``weight``, ``absmax``, ``quant_map``, ``quant_state.*``."""
BNB8 = "bnb-8bit"
"""bitsandbytes LLM.int8: int8 ``weight`` with per-row ``SCB`` scales."""
GGUF = "gguf"
"""llama.cpp GGUF: one ggml type per tensor (``Q4_K``, ``Q8_0``, ``F16`` ...), blocks self-describing."""

FAMILIES = (FP8, COMPRESSED, PACKED, NVFP4, MXFP4, GPTQ, AWQ, BNB4, BNB8, GGUF)


@dataclass(frozen=True)
class QuantScheme:
    """How one logical weight is quantized: enough to name it in a report, select it in a policy, and
    dequantize it."""

    name: str
    """The full name reports and policies use: ``fp8-e4m3 block 128x128``, ``int4 gptq g128 sym``,
    ``int4 awq g128``, ``mxfp4``, ``nvfp4``, ``nf4 blocksize 64``, ``int8 bnb``, ``Q4_K``."""
    family: str
    """One of :data:`FAMILIES`: which layout (and dequantizer) applies."""
    value: str
    """What one quantized value is: ``int4``, ``int8``, ``float8_e4m3fn``, ``fp4_e2m1``, ``nf4``, or a ggml type."""
    bits: int
    """Bits of one quantized value (not counting scales): 4, 8."""
    group: tuple[int, ...] | None = None
    """Elements that share one scale: ``(128, 128)`` for a 2-D block, ``(128,)`` for a group along the input
    dim, ``(-1,)`` for a whole row (per channel), ``()`` for one scale per tensor, None where not known."""
    symmetric: bool | None = None
    """True where there is no zero point; None where it does not apply or is not known."""
    params: Mapping[str, object] = field(default_factory=dict)
    """What a dequantizer needs beyond the above, by family: ``desc_act`` (GPTQ), ``pack_order`` (``gptq`` or
    ``awq``), ``quant_type`` and ``nested`` (bnb 4-bit), ``strategy`` (compressed-tensors ``tensor`` /
    ``channel`` / ``group`` / ``block``), ``ggml_type`` (GGUF's integer type id), ``format`` (compressed-tensors)."""

    @property
    def label(self) -> str:
        """The scheme without its value type, for ``int4 (gptq g128)`` in a table; ``""`` where the name is the value."""
        rest = self.name.split(" ", 1)
        return rest[1] if len(rest) == 2 and rest[0] == self.value_short else ""

    @property
    def display(self) -> str:
        """How a table shows it: ``int4 (gptq g128 sym)``, ``fp8-e4m3 (block 128x128)``, ``Q4_K``."""
        return f"{self.value_short} ({self.label})" if self.label else self.name

    @property
    def value_short(self) -> str:
        """The value type as the name starts with it (``fp8-e4m3`` for ``float8_e4m3fn``)."""
        return self.name.split(" ", 1)[0]


@dataclass(frozen=True)
class LogicalWeight:
    """One weight as the model sees it after loading, and the storage tensors that hold it."""

    name: str
    """The logical tensor name: ``model.layers.0.self_attn.q_proj.weight``."""
    module: str
    """The module that owns it: ``model.layers.0.self_attn.q_proj``."""
    scheme: QuantScheme
    """How it is quantized."""
    storage: Mapping[str, str]
    """Role -> storage tensor name, for the roles present. Roles: ``weight`` (quantized values stored
    unpacked), ``qweight``/``packed``/``blocks`` (packed values), ``scale`` (any scale, whatever the file calls
    it: ``weight_scale_inv``, ``scales``, ``weight_scale``, ``SCB``), ``global_scale``, ``zero``, ``g_idx``,
    ``absmax``, ``quant_map``, ``quant_state``, ``nested_absmax``, ``nested_quant_map``, ``shape`` (a stored
    logical shape, compressed-tensors' ``weight_shape``), ``input_scale`` (a static activation scale: the module's,
    not needed to dequantize the weight, dropped with it)."""
    shape: tuple[int, ...] | None
    """The logical shape (``[out_features, in_features]`` for a Linear); None where the storage does not say."""
    dequantizes_to: str
    """The dtype it dequantizes to (torch's name): the scale dtype or the config's, as the loader does."""
    bits_per_weight: float
    """Effective bits per logical element: every storage byte of it, scales included, over the element count."""
    file: str = ""
    """The file that holds its quantized values, relative to the checkpoint (``""`` for a single file)."""
    missing: tuple[str, ...] = ()
    """Roles the scheme requires that the checkpoint lacks (``scale``, ``zero``)."""
    elements: int | None = None
    """Logical elements where ``shape`` is None but the packing tells the count (bitsandbytes 4-bit keeps its
    shape in quant_state's bytes: two values per stored byte)."""

    @property
    def numel(self) -> int:
        """Logical elements: the product of ``shape``, else ``elements``, else 0."""
        return math.prod(self.shape) if self.shape is not None else (self.elements or 0)

    @property
    def storage_names(self) -> tuple[str, ...]:
        return tuple(self.storage.values())


@dataclass(frozen=True)
class QuantView:
    """The quantized side of one checkpoint: its logical weights and the storage they consume."""

    weights: tuple[LogicalWeight, ...]
    """Every logical weight that is quantized, in the order of its first storage tensor."""
    method: str | None = None
    """Where the scheme came from: config.json's ``quant_method`` (``fp8``, ``compressed-tensors``, ``gptq``,
    ``awq``, ``bitsandbytes``, ``mxfp4``), ``gguf``, or None where only name/shape patterns said so."""
    config: Mapping[str, object] = field(default_factory=dict)
    """The ``quantization_config`` as config.json has it ({} where none)."""
    not_converted: tuple[str, ...] = ()
    """Module names or patterns the config keeps unquantized (``ignore`` / ``modules_to_not_convert``)."""

    @property
    def consumed(self) -> frozenset[str]:
        """Storage tensor names that belong to some logical weight."""
        return frozenset(n for w in self.weights for n in w.storage.values())

    def by_storage(self) -> dict[str, LogicalWeight]:
        """Storage tensor name -> the logical weight it belongs to."""
        return {n: w for w in self.weights for n in w.storage.values()}

    def by_name(self) -> dict[str, LogicalWeight]:
        return {w.name: w for w in self.weights}

    def __bool__(self) -> bool:
        return bool(self.weights)


EMPTY = QuantView(())
"""The view of an unquantized checkpoint."""
