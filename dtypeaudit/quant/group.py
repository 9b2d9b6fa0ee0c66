"""Group an Inventory's storage tensors into logical weights (:class:`.model.QuantView`), from names, dtypes and
shapes, refined by config.json's ``quantization_config`` where there is one. Metadata only: no tensor bytes.

Each family is found by the tensor that holds its quantized values (its anchor) and the companions named after
it, as the loaders look them up:

- transformers ``fp8`` (``FP8Linear``, integrations/finegrained_fp8.py): ``X.weight`` float8 and
  ``X.weight_scale_inv`` fp32 ``[ceil(out/bo), ceil(in/bi)]`` (a 0-d scale without ``weight_block_size``);
- compressed-tensors (its compressors, checked against compressed-tensors 0.20 output): ``X.weight`` float8/int8
  with ``X.weight_scale`` (+ ``X.weight_zero_point``); ``X.weight_packed`` int32 ``[out, in*bits/32]`` with
  ``X.weight_shape``; nvfp4 ``X.weight_packed`` uint8 ``[out, in/2]``, fp8 ``X.weight_scale`` ``[out, in/16]``,
  ``X.weight_global_scale``; mxfp4 the same with a uint8 ``X.weight_scale`` ``[out, in/32]``;
- MXFP4 (gpt-oss, integrations/mxfp4.py): ``X_blocks`` uint8 ``[..., R, G, 16]`` and ``X_scales`` uint8
  ``[..., R, G]``; the loader's dequantized ``X`` is ``[E, G*32, R]`` (it transposes the last two dims);
- GPTQ / AWQ: ``X.qweight`` int32, ``X.qzeros``, ``X.scales`` ``[in/g, out]``, GPTQ's ``X.g_idx``; GPTQ packs
  ``qweight`` along the input dim (``[in*bits/32, out]``), AWQ along the output dim (``[in, out*bits/32]``);
- bitsandbytes (``Params4bit`` / ``Int8Params``): ``X.weight`` packed uint8 with ``X.weight.absmax``,
  ``X.weight.quant_map``, ``X.weight.quant_state.bitsandbytes__nf4|fp4`` (and ``nested_*`` for double
  quantization); 8-bit ``X.weight`` int8 with ``X.SCB``.

GGUF files are grouped by their reader: each quantized ggml tensor is a logical weight of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..inventory import Format, Inventory, TensorRecord, unique_tensors
from . import model
from .hints import FLOAT8, hints_quantization
from .model import LogicalWeight, QuantScheme, QuantView

_FP8_SHORT = {"float8_e4m3fn": "fp8-e4m3", "float8_e4m3fnuz": "fp8-e4m3fnuz", "float8_e5m2": "fp8-e5m2", "float8_e5m2fnuz": "fp8-e5m2fnuz"}
_BNB_STATE = re.compile(r"^(?P<w>.+)\.quant_state\.bitsandbytes__(?P<type>nf4|fp4)$")
_GGUF_METHOD = "gguf"
# A static activation scale belongs to its quantized Linear (compressed-tensors' input_scale, FP8Linear's
# activation_scale): a dequantized plain Linear has no such parameter.
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
# The families from_pretrained dequantizes on CPU into each parameter's own dtype (the model's)
_LOADED_AS_THE_MODEL = frozenset({model.FP8, model.MXFP4, model.COMPRESSED, model.PACKED, model.NVFP4})
_BNB4_PARTS = (".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")


def _config(inv: Inventory) -> dict[str, Any]:
    cfg = inv.metadata.get("quantization_config")
    return cfg if isinstance(cfg, dict) else {}


def _method(cfg: Mapping[str, Any]) -> str | None:
    method = cfg.get("quant_method")
    return method.lower() if isinstance(method, str) else None


def not_converted(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The config's list of modules kept unquantized (compressed-tensors ``ignore``, else transformers'
    ``modules_to_not_convert``)."""
    raw = cfg.get("ignore") if _method(cfg) == "compressed-tensors" else cfg.get("modules_to_not_convert")
    return tuple(p for p in raw if isinstance(p, str)) if isinstance(raw, list) else ()


def kept_unquantized(module: str, cfg: Mapping[str, Any]) -> bool:
    """Whether the config keeps ``module`` unquantized.

    compressed-tensors (``match_name``): a target equals the module name, or ``re:PATTERN`` re.matches it.
    transformers (``should_convert_module``): a pattern matches from the start up to a module boundary (as a
    regex), or is a suffix of the name."""
    patterns = not_converted(cfg)
    if _method(cfg) == "compressed-tensors":
        return any(_re_match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(_re_match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def _re_match(pattern: str, text: str) -> bool:
    try:
        return re.match(pattern, text) is not None
    except re.error:
        return False


def _dequant_dtype(inv: Inventory, *candidates: TensorRecord | None) -> str:
    """The dtype from_pretrained builds the dequantized weight in: config.json's dtype, else the first floating
    (non-fp8) scale's dtype, else bfloat16 (transformers' default for dequantized fp8/mxfp4 models)."""
    declared = inv.metadata.get("config_dtype")
    name = dtypes.canonical(declared) if isinstance(declared, str) and declared != "auto" else None
    if name is not None:
        return name
    for t in candidates:
        if t is not None and t.dtype in ("float16", "bfloat16", "float32"):
            return t.dtype
    return "bfloat16"


def _loaded_dtype(inv: Inventory) -> str:
    """The dtype from_pretrained builds the model in, which its dequantizing loads (``Fp8Dequantize``,
    ``Mxfp4Dequantize``, ``CompressedTensorsDequantize``) give each dequantized weight (the parameter's dtype) and
    the dtype plan gives every unquantized floating tensor: config.json's dtype (or the one a conversion plans),
    else what the folder's reader found (``hfload.main_dtype``: the index's ``metadata.dtype``, else the first
    floating tensor of the first shard), else, outside a folder, the first floating tensor that is not float8, its
    names sorted (``get_state_dict_dtype``), else float32."""
    declared = inv.metadata.get("config_dtype")
    name = dtypes.canonical(declared) if isinstance(declared, str) and declared != "auto" else None
    if name is not None:
        return name
    load = inv.metadata.get("from_pretrained_dtype")
    if isinstance(load, dict) and isinstance(load.get("dtype"), str):
        return str(load["dtype"])
    if isinstance(inv.metadata.get("model_dtype"), str):  # a folder whose quantizer's dtype plan is not modelled
        return str(inv.metadata["model_dtype"])
    shards = inv.metadata.get("shards")
    first = shards[0] if isinstance(shards, list) and shards else None
    for t in sorted((t for t in inv.tensors if first is None or t.file == first), key=lambda t: t.name):
        if dtypes.is_floating(t.dtype) and not t.dtype.startswith(("float8_", "float4_")):
            return t.dtype
    return "float32"


def _bits(storage: list[TensorRecord], numel: int) -> float:
    return round(sum(t.nbytes for t in storage) * 8 / numel, 3) if numel else 0.0


class _Grouper:
    """One pass over one inventory; ``taken`` keeps a storage tensor in one logical weight."""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.cfg = _config(inv)
        self.method = _method(self.cfg)
        self.by = inv.by_name()
        self.taken: set[str] = set()
        self.out: list[LogicalWeight] = []

    def get(self, name: str) -> TensorRecord | None:
        t = self.by.get(name)
        return t if t is not None and name not in self.taken else None

    def add(
        self,
        name: str,
        module: str,
        scheme: QuantScheme,
        roles: Mapping[str, TensorRecord | None],
        shape: tuple[int, ...] | None,
        required: tuple[str, ...],
        *,
        numel: int | None = None,
        to: str | None = None,
    ) -> None:
        present = {role: t for role, t in roles.items() if t is not None}
        for suffix in _ACTIVATION_SCALES:
            act = self.get(module + suffix)
            if act is not None and act.numel <= 1:
                present.setdefault("input_scale", act)
        anchor = next(iter(present.values()))
        if to is None and scheme.family in _LOADED_AS_THE_MODEL:
            to = _loaded_dtype(self.inv)
        count = numel if numel is not None else (math.prod(shape) if shape is not None else 0)
        weight = LogicalWeight(
            name=name,
            module=module,
            scheme=scheme,
            storage={role: t.name for role, t in present.items()},
            shape=shape,
            dequantizes_to=to or _dequant_dtype(self.inv, roles.get("scale")),
            bits_per_weight=_bits(list(present.values()), count),
            file=anchor.file,
            missing=tuple(r for r in required if r not in present),
            elements=count if shape is None else None,
        )
        self.taken.update(weight.storage.values())
        self.out.append(weight)

    # -- families ------------------------------------------------------------------------------

    def run(self) -> QuantView:
        if self.inv.format == Format.GGUF:
            return QuantView(tuple(_gguf_weights(self.inv)), _GGUF_METHOD)
        for t in self.inv.tensors:
            if t.name in self.taken:
                continue
            if t.name.endswith(".qweight"):
                self.gptq_awq(t)
            elif t.name.endswith(".weight_packed"):
                self.packed(t)
            elif t.name.endswith("_blocks") and t.dtype == "uint8":
                self.mxfp4(t)
            elif t.name.endswith(".weight"):
                self.plain_weight(t)
        index = {t.name: i for i, t in enumerate(self.inv.tensors)}
        self.out.sort(key=lambda w: min(index[n] for n in w.storage.values()))
        return QuantView(tuple(self.out), self.method, dict(self.cfg), not_converted(self.cfg))

    def plain_weight(self, t: TensorRecord) -> None:
        """A quantized weight stored under the plain ``.weight`` name: fp8 (both methods), int8 (compressed-tensors
        or bitsandbytes), bitsandbytes 4-bit (packed uint8)."""
        module = t.name[: -len(".weight")]
        scale_inv = self.get(module + ".weight_scale_inv")
        scale = self.get(module + ".weight_scale")
        if t.dtype == "uint8" and any(self.get(t.name + part) is not None for part in _BNB4_PARTS):
            return self.bnb4(t, module)
        if t.dtype == "int8" and (self.get(module + ".SCB") is not None or (self.method == "bitsandbytes" and scale is None)):
            return self.bnb8(t, module)
        if self.kept(module) and scale is None and scale_inv is None:
            if self.method == "fp8" and t.dtype in FLOAT8:
                # Fp8Dequantize casts a weight without a scale to the model's dtype, unscaled: a logical weight
                # with nothing missing, whose dequantization is that cast
                return self.fp8(t, module, None, required=())
            return None  # the config keeps it as stored
        if t.dtype in FLOAT8 and (scale_inv is not None or (self.method == "fp8" and scale is None)):
            return self.fp8(t, module, scale_inv)
        if self.method == "fp8" and scale_inv is not None and t.dtype in ("bfloat16", "float16", "float32", "float64", "int8"):
            # Fp8Dequantize multiplies any X.weight that has an X.weight_scale_inv, whatever its dtype (int8: packed fp4)
            return self.fp8(t, module, scale_inv)
        compressed = self.method == "compressed-tensors"
        if (t.dtype in FLOAT8 or t.dtype == "int8") and (scale is not None or (compressed and scale_inv is None)):
            return self.compressed(t, module, scale)
        return None

    def kept(self, module: str) -> bool:
        return bool(self.cfg) and kept_unquantized(module, self.cfg)

    def fp8(self, t: TensorRecord, module: str, scale: TensorRecord | None, *, required: tuple[str, ...] = ("scale",)) -> None:
        """transformers' ``Fp8Dequantize`` (what from_pretrained runs on CPU): the block comes from the scale grid,
        which must divide the weight (else the load fails); DeepSeek's reference (``weight_dequant``) takes the
        config's ``weight_block_size`` with partial edge blocks. ``params`` keeps both readings (see
        :func:`loader_reading`); ``group`` is the loader's block where it loads, else the config's."""
        config_block = _config_block(self.cfg) if self.method == "fp8" else None
        # an int8 weight is two fp4 e2m1 values a byte to Fp8Dequantize (MoE experts shipped as packed FP4)
        packed = t.dtype == "int8"
        shape = (*t.shape[:-1], t.shape[-1] * 2) if packed and t.shape else t.shape
        loader_block = _loader_block(shape, scale.shape if scale is not None else None)
        group: tuple[int, ...]
        if scale is None or scale.numel <= 1 and len(scale.shape) < 2:
            group = ()
        elif isinstance(loader_block, tuple):
            if scale.numel == 1:
                group = ()
            elif config_block is not None and _same_blocks(config_block, loader_block, shape[-2:], scale.shape[-2:]):
                group = config_block  # the same elements under each scale: named as the config names them
            else:
                group = loader_block
        elif config_block is not None:
            group = config_block
        elif len(scale.shape) == len(shape) >= 2:
            group = _block_from_shapes(shape[-2:], scale.shape[-2:])
        else:
            group = ()
        short = "fp4-e2m1" if packed else _FP8_SHORT.get(t.dtype, t.dtype)
        name = f"{short} block {group[0]}x{group[1]}" if group else f"{short} per-tensor" if scale is not None else f"{short} unscaled"
        params = {
            "scale_dtype": scale.dtype if scale else None,
            "config_block": config_block,
            "loader_block": loader_block if isinstance(loader_block, tuple) else None,
            "loader_refuses": loader_block if isinstance(loader_block, str) else None,
            "grid": tuple(scale.shape[-2:]) if scale is not None and len(scale.shape) >= 2 else None,
        }
        value, bits = ("fp4_e2m1", 4) if packed else (t.dtype, 8 if t.dtype in FLOAT8 else dtypes.get(t.dtype).itemsize * 8)
        scheme = QuantScheme(name, model.FP8, value, bits, group, True, params)
        self.add(t.name, module, scheme, {"weight": t, "scale": scale}, shape, required)

    def compressed(self, t: TensorRecord, module: str, scale: TensorRecord | None) -> None:
        args = self.ct_weights(module)
        zero = self.get(module + ".weight_zero_point")
        g_idx = self.get(module + ".weight_g_idx")
        strategy = str(args.get("strategy") or _strategy_from_shapes(t, scale))
        group = _ct_group(args, strategy, t, scale)
        symmetric = bool(args.get("symmetric", zero is None))
        value = "fp8-e4m3" if t.dtype == "float8_e4m3fn" else _FP8_SHORT.get(t.dtype, t.dtype)
        scheme = QuantScheme(
            f"{value} compressed {_strategy_text(strategy, group)}" + ("" if symmetric else " asym"),
            model.COMPRESSED,
            t.dtype,
            8,
            group,
            symmetric,
            {"strategy": strategy, "format": self.cfg.get("format")},
        )
        required = ("scale",) if symmetric else ("scale", "zero")
        self.add(t.name, module, scheme, {"weight": t, "scale": scale, "zero": zero, "g_idx": g_idx}, t.shape, required)

    def packed(self, t: TensorRecord) -> None:
        module = t.name[: -len(".weight_packed")]
        scale = self.get(module + ".weight_scale")
        global_scale = self.get(module + ".weight_global_scale")
        args = self.ct_weights(module)
        roles: dict[str, TensorRecord | None] = {"packed": t, "scale": scale}
        if t.dtype == "uint8":
            # fp4 e2m1, two per byte: nvfp4 (fp8 group-16 scales and a global scale) or mxfp4 (e8m0 group-32 scales)
            nv = (
                global_scale is not None
                or (scale is not None and scale.dtype in FLOAT8)
                or self.cfg.get("format") == "nvfp4-pack-quantized"
            )
            shape = (t.shape[0], t.shape[1] * 2) if len(t.shape) == 2 else None
            size = 16 if nv else 32
            family = model.NVFP4 if nv else model.MXFP4
            scheme = QuantScheme("nvfp4" if nv else "mxfp4", family, "fp4_e2m1", 4, (size,), True, {"layout": "compressed-tensors"})
            if nv:
                roles["global_scale"] = global_scale
            required = ("scale", "global_scale") if nv else ("scale",)
            return self.add(module + ".weight", module, scheme, roles, shape, required)
        bits = int(args.get("num_bits", 4))
        shape_t = self.get(module + ".weight_shape")
        zero = self.get(module + ".weight_zero_point")
        roles.update(zero=zero, g_idx=self.get(module + ".weight_g_idx"), shape=shape_t)
        symmetric = bool(args.get("symmetric", zero is None))
        # weight_shape holds the logical shape in its bytes; the rows and the packing give it without reading them
        shape = (t.shape[0], t.shape[1] * 32 // bits) if len(t.shape) == 2 else None
        strategy = str(args.get("strategy") or "group")
        group = _ct_group(args, strategy, None, scale) if shape is None else _ct_group(args, strategy, t.with_(shape=shape), scale)
        scheme = QuantScheme(
            f"int{bits} compressed {_strategy_text(strategy, group)}" + ("" if symmetric else " asym"),
            model.PACKED,
            f"int{bits}",
            bits,
            group,
            symmetric,
            {"strategy": strategy, "format": self.cfg.get("format")},
        )
        required = ("scale",) if symmetric else ("scale", "zero")
        self.add(module + ".weight", module, scheme, roles, shape, required)

    def ct_weights(self, module: str) -> dict[str, Any]:
        """The ``weights`` args of the compressed-tensors config group that dequantizes ``module``, as transformers'
        ``CompressedTensorsDequantize`` (from_pretrained's CPU dequantizing load) picks it, whatever the targets: a
        dense module gets the first group whose targets do not single out the experts (``get_dense_scheme``), an
        expert the first group with an ``re:`` target naming experts, else the first with a class-name target,
        else the first (``get_experts_scheme``)."""
        groups = self.cfg.get("config_groups")
        if not isinstance(groups, dict):
            return {}
        usable = [g for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
        if not usable:
            return {}

        def targets(g: dict[str, Any]) -> list[str]:
            return [t for t in g.get("targets") or [] if isinstance(t, str)]

        def experts(g: dict[str, Any]) -> bool:
            return any(t.startswith("re:") and "experts" in t for t in targets(g))

        if ".experts." in f".{module}.":
            chosen = next((g for g in usable if experts(g)), None) or next(
                (g for g in usable if any(not t.startswith("re:") for t in targets(g))), usable[0]
            )
        else:
            chosen = next((g for g in usable if not experts(g)), usable[0])
        return dict(chosen["weights"])

    def mxfp4(self, t: TensorRecord) -> None:
        base = t.name[: -len("_blocks")]
        scales = self.get(base + "_scales")
        # _convert_moe_packed_tensors: [*prefix, R, G, B] -> [*prefix, R, G*B*2] -> transpose(1, 2)
        shape: tuple[int, ...] | None = None
        if len(t.shape) >= 3:
            *prefix, rows, g, b = t.shape
            flat = (*prefix, rows, g * b * 2)
            shape = (flat[0], flat[2], flat[1], *flat[3:]) if len(flat) >= 3 else flat
        module = base.rsplit(".", 1)[0] if "." in base else base
        params: dict[str, object] = {"layout": "gpt-oss"}
        want = self.gpt_oss_shape(base)
        if shape is not None and want is not None and shape != want:
            params["loader_refuses"] = (
                f"its blocks dequantize to {list(shape)}, but the model's parameter is {list(want)} (a size mismatch)"
            )
        scheme = QuantScheme("mxfp4", model.MXFP4, "fp4_e2m1", 4, (32,), True, params)
        self.add(base, module, scheme, {"blocks": t, "scale": scales}, shape, ("scale",))

    def gpt_oss_shape(self, base: str) -> tuple[int, ...] | None:
        """The shape of gpt-oss's ``GptOssExperts`` parameter ``base`` (``gate_up_proj`` ``[E, hidden, 2*inter]``,
        ``down_proj`` ``[E, inter, hidden]``), the dims read off its stored biases (``[E, 2*inter]``, ``[E, hidden]``),
        which the same config sizes; None where a bias is not stored."""
        stem, _, proj = base.rpartition(".")
        gate_up, down = self.by.get(f"{stem}.gate_up_proj_bias"), self.by.get(f"{stem}.down_proj_bias")
        if proj not in ("gate_up_proj", "down_proj") or gate_up is None or down is None:
            return None
        if len(gate_up.shape) != 2 or len(down.shape) != 2:
            return None
        experts, inter2 = gate_up.shape
        hidden = down.shape[1]
        return (experts, hidden, inter2) if proj == "gate_up_proj" else (experts, inter2 // 2, hidden)

    def gptq_awq(self, t: TensorRecord) -> None:
        module = t.name[: -len(".qweight")]
        zeros = self.get(module + ".qzeros")
        scales = self.get(module + ".scales")
        g_idx = self.get(module + ".g_idx")
        awq = self.method == "awq" or (self.method != "gptq" and g_idx is None and _looks_awq(t, scales))
        bits = self.cfg.get("bits", self.cfg.get("w_bit"))
        if not isinstance(bits, int) or bits <= 0:
            bits = _bits_from_zeros(zeros, scales) or 4
        shape: tuple[int, ...] | None = None
        if len(t.shape) == 2:
            if awq:
                shape = (scales.shape[1] if scales is not None and len(scales.shape) == 2 else t.shape[1] * 32 // bits, t.shape[0])
            else:
                shape = (t.shape[1], t.shape[0] * 32 // bits)
        group_size = self.cfg.get("group_size", self.cfg.get("q_group_size"))
        if not isinstance(group_size, int):
            group_size = (
                shape[1] // scales.shape[0] if shape is not None and scales is not None and scales.shape and scales.shape[0] else None
            )
        g = "" if group_size is None else (" per-channel" if group_size in (-1, 0) else f" g{group_size}")
        if awq:
            scheme = QuantScheme(f"int{bits} awq{g}", model.AWQ, f"int{bits}", bits, _group(group_size), False, {"pack_order": "awq"})
        else:
            sym = self.cfg.get("sym", True)
            desc_act = bool(self.cfg.get("desc_act", False))
            scheme = QuantScheme(
                f"int{bits} gptq{g} {'sym' if sym else 'asym'}" + (" act-order" if desc_act else ""),
                model.GPTQ,
                f"int{bits}",
                bits,
                _group(group_size),
                bool(sym),
                {"pack_order": "gptq", "desc_act": desc_act, "checkpoint_format": self.cfg.get("checkpoint_format", "gptq")},
            )
        roles = {"qweight": t, "scale": scales, "zero": zeros, "g_idx": g_idx}
        self.add(module + ".weight", module, scheme, roles, shape, ("scale", "zero"))

    def bnb4(self, t: TensorRecord, module: str) -> None:
        roles: dict[str, TensorRecord | None] = {
            "weight": t,
            "absmax": self.get(t.name + ".absmax"),
            "quant_map": self.get(t.name + ".quant_map"),
        }
        quant_type = str(self.cfg.get("bnb_4bit_quant_type", "nf4"))
        for name in (f"{t.name}.quant_state.bitsandbytes__nf4", f"{t.name}.quant_state.bitsandbytes__fp4"):
            state = self.get(name)
            if state is not None:
                roles["quant_state"] = state
                match = _BNB_STATE.match(name)
                quant_type = match.group("type") if match else quant_type
        nested = self.get(t.name + ".nested_absmax")
        if nested is not None:
            roles.update(nested_absmax=nested, nested_quant_map=self.get(t.name + ".nested_quant_map"))
        numel = t.numel * 2  # two 4-bit values per byte; the logical shape is in quant_state's bytes
        absmax = roles["absmax"]
        blocksize = _pow2_at_least(numel // absmax.numel) if absmax is not None and absmax.numel else None
        name = quant_type + (f" blocksize {blocksize}" if blocksize else "") + (" double-quant" if nested is not None else "")
        scheme = QuantScheme(
            name, model.BNB4, quant_type, 4, _group(blocksize), True, {"quant_type": quant_type, "nested": nested is not None}
        )
        self.add(module + ".weight", module, scheme, roles, None, ("absmax", "quant_map", "quant_state"), numel=numel, to=self.bnb_dtype())

    def bnb8(self, t: TensorRecord, module: str) -> None:
        scb = self.get(module + ".SCB")
        fmt = self.get(module + ".weight_format")
        roles = {"weight": t, "scale": scb, "weight_format": fmt}
        scheme = QuantScheme("int8 bnb", model.BNB8, "int8", 8, (-1,), True)
        self.add(t.name, module, scheme, roles, t.shape, ("scale",), to=self.bnb_dtype())

    def bnb_dtype(self) -> str:
        """``model.dequantize()`` casts each weight to ``model.config.dtype``: in a folder, the dtype from_pretrained
        loaded the model in (config.json's, else the first shard's first floating tensor; the unquantized parts stay
        as stored under bitsandbytes); a bare file says none, and float16 is bitsandbytes' usual one."""
        if self.inv.format == Format.HF_DIRECTORY:
            return _loaded_dtype(self.inv)
        return _dequant_dtype(self.inv, None) if self.inv.metadata.get("config_dtype") else "float16"


def _group(size: int | None) -> tuple[int, ...] | None:
    if size is None:
        return None
    return (-1,) if size in (-1, 0) else (size,)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_from_shapes(weight: tuple[int, ...], scale: tuple[int, ...]) -> tuple[int, int]:
    """The block that tiles ``weight`` into ``scale``'s grid (ceil division), rounded up to a power of two as
    the writers choose them (DeepSeek's and transformers' 128x128)."""
    return (_pow2_at_least(-(-weight[0] // scale[0])), _pow2_at_least(-(-weight[1] // scale[1])))


def _config_block(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    block = cfg.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return (block[0], block[1])
    return None


def _same_blocks(config: tuple[int, ...], loader: tuple[int, ...], weight: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    """Whether DeepSeek's reading (the ``config`` block, ceil-divided, partial edge blocks) and the loader's
    (``loader``: the grid divides the weight) put every element under the same scale of ``grid``: the config's
    block tiles the weight into that grid, and in each dim the blocks are the same size or the grid is one."""
    return all(-(-d // c) == n and (c == b or n == 1) for c, b, d, n in zip(config, loader, weight, grid, strict=True))


def _loader_block(weight: tuple[int, ...], scale: tuple[int, ...] | None) -> tuple[int, int] | str | None:
    """The block transformers' ``Fp8Dequantize._dequantize_one`` (5.24, what from_pretrained runs on CPU) takes:
    the weight's last two dims over the scale grid's, which must divide them exactly; a scale of fewer than two
    dims is one grid cell (its ``except`` branch), so it must hold one value. A string says why the load fails
    instead; None where there is no scale."""
    if scale is None:
        return None
    if len(weight) < 2:
        return f"a {len(weight)}-D weight with a scale (the loader needs rows and columns)"
    rows, cols = weight[-2:]
    if len(scale) < 2:
        if math.prod(scale) != 1:
            return f"a {list(scale)} scale over {list(weight)} (the loader reads a 1-D scale as one grid cell)"
        return (rows, cols)
    sr, sc = scale[-2:]
    if not sr or not sc or rows % sr or cols % sc:
        return f"its scale grid {[sr, sc]} does not divide the weight's {[rows, cols]}"
    lead, scale_lead = math.prod(weight[:-2]), math.prod(scale[:-2])
    if scale_lead not in (1, lead):
        return f"its scale grid {list(scale)} does not match the weight's leading dims {list(weight[:-2])}"
    return (rows // sr, cols // sc)


def loader_reading(w: LogicalWeight) -> tuple[str, str] | None:
    """Where the references of transformers' ``fp8`` layout part on ``w``: ``("refused", why)`` where
    from_pretrained fails on it, ``("differ", why)`` where it loads but DeepSeek's reference (``weight_dequant``:
    the config's ``weight_block_size``, partial edge blocks) reads other blocks, ``("config", why)`` where only the
    config's block size disagrees with the grid and nothing else reads the config's; None where all agree."""
    p = w.scheme.params
    if w.scheme.family == model.MXFP4 and isinstance(p.get("loader_refuses"), str):
        return ("refused", f"from_pretrained cannot load {w.name}: {p['loader_refuses']}")
    if w.scheme.family != model.FP8 or "scale" not in w.storage or w.shape is None:
        return None
    config_block, loader_block, refuses = p.get("config_block"), p.get("loader_block"), p.get("loader_refuses")
    deepseek = None
    if isinstance(config_block, tuple) and len(w.shape) >= 2:
        rows, cols = w.shape[-2:]
        deepseek = (-(-rows // config_block[0]), -(-cols // config_block[1]))
    if isinstance(refuses, str):
        text = f"from_pretrained cannot load {w.name}: {refuses}"
        if deepseek is not None and isinstance(config_block, tuple) and p.get("grid") == deepseek:
            text += f" (DeepSeek's reference reads it as the config's {config_block[0]}x{config_block[1]} blocks, partial at the edges)"
        return ("refused", text)
    grid = p.get("grid")
    if not isinstance(loader_block, tuple) or not isinstance(config_block, tuple) or not isinstance(grid, tuple):
        return None
    if _same_blocks(config_block, loader_block, w.shape[-2:], grid):
        return None
    lb, cb, shown = loader_block, config_block, list(grid)
    if grid == deepseek:
        return (
            "differ",
            f"{w.name}: transformers' from_pretrained reads its {shown} scale grid as {lb[0]}x{lb[1]} blocks, "
            f"DeepSeek's reference as the config's {cb[0]}x{cb[1]} blocks with partial edges; they give different weights",
        )
    return (
        "config",
        f"{w.name}: quantization_config.weight_block_size says {cb[0]}x{cb[1]}, but its scale grid "
        f"{shown} gives {lb[0]}x{lb[1]} blocks, which from_pretrained follows",
    )


def _strategy_from_shapes(t: TensorRecord, scale: TensorRecord | None) -> str:
    if scale is None or scale.numel <= 1:
        return "tensor"
    if len(scale.shape) == 2 and len(t.shape) == 2 and scale.shape[1] == 1 and scale.shape[0] == t.shape[0]:
        return "channel"
    if len(scale.shape) == 2 and len(t.shape) == 2 and scale.shape[0] == t.shape[0]:
        return "group"
    return "block"


def _ct_group(args: Mapping[str, Any], strategy: str, t: TensorRecord | None, scale: TensorRecord | None) -> tuple[int, ...] | None:
    if strategy == "tensor":
        return ()
    if strategy == "channel":
        return (-1,)
    if strategy == "block":
        block = args.get("block_structure")
        if isinstance(block, list) and len(block) == 2:
            return (int(block[0]), int(block[1]))
        if t is not None and scale is not None and len(t.shape) == 2 and len(scale.shape) == 2:
            return _block_from_shapes(t.shape, scale.shape)
        return None
    size = args.get("group_size")
    if isinstance(size, int):
        return (size,)
    if t is not None and scale is not None and len(t.shape) == 2 and len(scale.shape) == 2 and scale.shape[1]:
        return (t.shape[1] // scale.shape[1],)
    return None


def _strategy_text(strategy: str, group: tuple[int, ...] | None) -> str:
    if strategy == "block" and group:
        return f"block {'x'.join(map(str, group))}"
    if strategy in ("group", "tensor_group") and group:
        return f"g{group[0]}"
    if strategy == "channel":
        return "per-channel"
    if strategy == "tensor":
        return "per-tensor"
    return strategy


def _looks_awq(qweight: TensorRecord, scales: TensorRecord | None) -> bool:
    """AWQ packs along the output dim, so its qweight has fewer columns than scales; GPTQ's has as many."""
    return scales is not None and len(scales.shape) == 2 and len(qweight.shape) == 2 and qweight.shape[1] < scales.shape[1]


def _bits_from_zeros(zeros: TensorRecord | None, scales: TensorRecord | None) -> int | None:
    """qzeros packs ``out`` zero points of ``bits`` each into int32: ``out * bits / 32`` columns (both layouts)."""
    if zeros is None or scales is None or len(zeros.shape) != 2 or len(scales.shape) != 2 or not scales.shape[1]:
        return None
    bits = zeros.shape[1] * 32 // scales.shape[1]
    return bits if bits in (2, 3, 4, 8) else None


def _gguf_weights(inv: Inventory) -> list[LogicalWeight]:
    """GGUF: the reader records each quantized tensor as raw bytes with its ggml type and logical shape in
    ``metadata['gguf_quantized']`` (name -> [type name, type id, shape]); each is a logical weight."""
    table = inv.metadata.get("gguf_quantized")
    if not isinstance(table, dict):
        return []
    out = []
    for t in inv.tensors:
        entry = table.get(t.name)
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            continue
        type_name, type_id, shape = entry
        shape = tuple(int(d) for d in shape)
        bits = _gguf_value_bits(str(type_name))
        scheme = QuantScheme(str(type_name), model.GGUF, str(type_name), bits, None, None, {"ggml_type": int(type_id)})
        numel = math.prod(shape)
        out.append(
            LogicalWeight(
                name=t.name,
                module=t.name.rsplit(".", 1)[0] if "." in t.name else t.name,
                scheme=scheme,
                storage={"weight": t.name},
                shape=shape,
                dequantizes_to="float32",  # gguf.quants.dequantize and llama.cpp's dequantize_row_* give float32
                bits_per_weight=_bits([t], numel),
                file=t.file,
            )
        )
    return out


def _gguf_value_bits(type_name: str) -> int:
    m = re.match(r"^(?:I?Q|TQ)(\d)", type_name)
    return int(m.group(1)) if m else 8


_recent: list[tuple[Inventory, QuantView]] = []
"""The last two inventories grouped (a scan's and its annotated copy), held so that their ids stay theirs:
the checks and renderers of one checkpoint ask for its view several times."""


def view(inv: Inventory) -> QuantView:
    """The logical weights of ``inv``; :data:`.model.EMPTY` for a checkpoint with none (the usual case, found
    without building anything when no name or dtype hints at quantization)."""
    for seen, quant in list(_recent):
        if seen is inv:
            return quant
    if not _config(inv) and inv.format != Format.GGUF and not any(hints_quantization(t) for t in inv.tensors):
        quant = model.EMPTY
    else:
        quant = _Grouper(inv).run()
    _recent[:] = [(inv, quant), *_recent[:1]]
    return quant


def policy_records(inv: Inventory, quant: QuantView | None = None) -> tuple[TensorRecord, ...]:
    """What policies and dtype summaries judge: each logical weight as one record in its logical dtype (in place
    of its first storage tensor, with ``scheme`` set), and every tensor no logical weight consumes, unchanged.
    The inventory's own tuple where nothing is quantized."""
    quant = view(inv) if quant is None else quant
    if not quant:
        return inv.tensors
    owner = quant.by_storage()
    by = inv.by_name()
    out: list[TensorRecord] = []
    for t in inv.tensors:
        w = owner.get(t.name)
        if w is None:
            out.append(t)
        elif t.name == next(iter(w.storage.values())):
            shape = w.shape if w.shape is not None else (w.numel,)  # a flat count where the shape is in the bytes
            nbytes = sum(by[n].nbytes for n in w.storage.values() if n in by)
            out.append(t.with_(name=w.name, dtype=w.dequantizes_to, shape=shape, nbytes=nbytes, layout="quantized", scheme=w.scheme.name))
    return tuple(out)


@dataclass(frozen=True)
class SchemeTotals:
    """Per-scheme totals for a summary line."""

    scheme: str
    weights: int
    """Logical weights in this scheme."""
    numel: int
    """Their logical elements (0 where a shape is unknown and no count is)."""
    nbytes: int
    """Bytes of all their storage, scales included."""
    bits_per_weight: float
    share: float
    """Fraction of the checkpoint's bytes."""


def scheme_summary(inv: Inventory, quant: QuantView) -> list[SchemeTotals]:
    """Totals by scheme, largest first; unquantized tensors are the dtype summary's business."""
    by = inv.by_name()
    total = sum(t.nbytes for t in unique_tensors(inv.tensors)) or 1
    acc: dict[str, list[int]] = {}
    for w in quant.weights:
        nbytes = sum(by[n].nbytes for n in w.storage.values() if n in by)
        numel = w.numel
        row = acc.setdefault(w.scheme.name, [0, 0, 0])
        row[0] += 1
        row[1] += numel
        row[2] += nbytes
    rows = [SchemeTotals(s, c[0], c[1], c[2], round(c[2] * 8 / c[1], 3) if c[1] else 0.0, c[2] / total) for s, c in acc.items()]
    return sorted(rows, key=lambda r: (-r.nbytes, r.scheme))
