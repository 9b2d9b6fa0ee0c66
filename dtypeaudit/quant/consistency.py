"""Consistency findings for quantized checkpoints: what a loader would build wrong from these tensors.

Each check compares the storage a logical weight has with what the loader of its scheme allocates
(transformers' ``FP8Linear``, ``Mxfp4GptOssExperts``, compressed-tensors' ``initialize_module_for_quantization``,
GPTQ/AWQ ``QuantLinear``, bitsandbytes' ``Linear4bit``/``Linear8bitLt``), so a finding names what the loaded
model would hold instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..inventory import Finding, Inventory, Severity, TensorRecord
from . import model
from .group import FLOAT8, kept_unquantized, loader_reading, view
from .model import LogicalWeight, QuantView

_LOADER = {
    model.FP8: "transformers' FP8Linear",
    model.COMPRESSED: "compressed-tensors",
    model.PACKED: "compressed-tensors",
    model.NVFP4: "compressed-tensors",
    model.MXFP4: "the MXFP4 loader",
    model.GPTQ: "the GPTQ QuantLinear",
    model.AWQ: "the AWQ QuantLinear",
    model.BNB4: "bitsandbytes' Linear4bit",
    model.BNB8: "bitsandbytes' Linear8bitLt",
}

# config.json quant_method -> the families its loader reads
_METHOD_FAMILIES: dict[str, frozenset[str]] = {
    "fp8": frozenset({model.FP8}),
    "compressed-tensors": frozenset({model.COMPRESSED, model.PACKED, model.NVFP4, model.MXFP4}),
    "gptq": frozenset({model.GPTQ}),
    "awq": frozenset({model.AWQ}),
    "bitsandbytes": frozenset({model.BNB4, model.BNB8}),
    "mxfp4": frozenset({model.MXFP4}),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# What the loader was seen to do with such a weight (tests/test_quant_scan.py loads one).
_MISSING_EFFECT = {
    model.FP8: "from_pretrained reports no missing key: on CPU, where it dequantizes, it casts the float8 values unscaled",
}


def missing_parts(inv: Inventory, quant: QuantView) -> list[Finding]:
    """A quantized weight whose scale / zero point / state is not stored: nothing can dequantize it correctly."""
    out = []
    for w in quant.weights:
        if not w.missing:
            continue
        loader = _LOADER.get(w.scheme.family, "the loader")
        effect = _MISSING_EFFECT.get(w.scheme.family, f"{loader} has nothing to dequantize it with")
        out.append(
            Finding(
                "quant-missing-scale",
                "error",
                f"{w.name} is {w.scheme.name} but its {', '.join(w.missing)} tensor is not stored; "
                f"{effect}, so the layer's values are wrong",
                tensor=w.name,
                file=w.file or None,
            )
        )
    return out


def _expected_shapes(w: LogicalWeight, by: dict[str, TensorRecord]) -> dict[str, tuple[int, ...]]:
    """Role -> the shape the loader allocates for it, where the scheme and the logical shape fix one."""
    s = w.scheme
    shape = w.shape
    if shape is None or len(shape) < 2:
        return {}
    out_f, in_f = shape[-2], shape[-1]
    if s.family == model.FP8:
        return {}  # the grid gives the block: fp8_blocks
    if s.family in (model.COMPRESSED, model.PACKED, model.NVFP4) or (
        s.family == model.MXFP4 and s.params.get("layout") == "compressed-tensors"
    ):
        strategy = s.params.get("strategy")
        want: dict[str, tuple[int, ...]] = {}
        if s.family in (model.NVFP4, model.MXFP4) and s.group:
            want["scale"] = (out_f, _cdiv(in_f, s.group[0]))
        elif strategy == "channel":
            want["scale"] = (out_f, 1)
        elif strategy in ("group", "tensor_group") and s.group:
            want["scale"] = (out_f, _cdiv(in_f, s.group[0]))
        elif strategy == "block" and s.group and len(s.group) == 2:
            want["scale"] = (_cdiv(out_f, s.group[0]), _cdiv(in_f, s.group[1]))
        if "scale" in want and "zero" in w.storage and s.family == model.COMPRESSED:
            want["zero"] = want["scale"]
        if "scale" in want and "zero" in w.storage and s.family == model.PACKED:
            # pack_quantized packs zero points along the output dim: [ceil(out*bits/32), groups]
            want["zero"] = (_cdiv(out_f * s.bits, 32), want["scale"][1])
        return want
    if s.family == model.MXFP4:
        blocks = by.get(w.storage.get("blocks", ""))
        return {"scale": blocks.shape[:-1]} if blocks is not None else {}  # the loader asserts this
    if s.family in (model.GPTQ, model.AWQ):
        if not s.group:
            return {}
        groups = 1 if s.group == (-1,) else _cdiv(in_f, s.group[0])
        want = {"scale": (groups, out_f), "zero": (groups, out_f * s.bits // 32)}
        if s.family == model.GPTQ:
            want["g_idx"] = (in_f,)
        return want
    if s.family == model.BNB8:
        return {"scale": (out_f,)}
    return {}


def scale_shapes(inv: Inventory, quant: QuantView) -> list[Finding]:
    """Scale / zero / index tensors whose shape does not fit the scheme's block or group and the weight's shape:
    the loader either refuses them (a size mismatch) or applies each scale to the wrong block."""
    by = inv.by_name()
    out = []
    for w in quant.weights:
        for role, want in _expected_shapes(w, by).items():
            t = by.get(w.storage.get(role, ""))
            if t is None or tuple(t.shape) == tuple(want):
                continue
            out.append(
                Finding(
                    "quant-scale-shape",
                    "error",
                    f"{t.name} is {list(t.shape)}, but {w.scheme.name} over a {list(w.shape or ())} weight needs {list(want)}; "
                    "the loader refuses it (size mismatch) or scales the wrong blocks",
                    tensor=t.name,
                    file=t.file or None,
                    expected=(str(list(want)),),
                    actual=str(list(t.shape)),
                )
            )
    return out


_FP8_SEVERITY: dict[str, Severity] = {"refused": "error", "differ": "warning", "config": "warning"}
_FP8_EFFECT = {
    "refused": "; convert refuses it too",
    "differ": "; convert follows neither until told which (convert --fp8-reference transformers|deepseek)",
    "config": "; convert follows from_pretrained",
}


def loader_readings(inv: Inventory, quant: QuantView) -> list[Finding]:
    """Weights as from_pretrained reads them (``group.loader_reading``): one it cannot load (an error: an FP8 scale
    grid that does not divide its weight, MXFP4 blocks of another shape than the parameter), an FP8 grid DeepSeek's
    reference reads as other blocks, one whose config block size only disagrees (warnings: it loads)."""
    by = inv.by_name()
    out = []
    for w in quant.weights:
        reading = loader_reading(w)
        if reading is None:
            continue
        kind, text = reading
        effect = _FP8_EFFECT[kind]
        if kind == "refused" and w.scheme.family == model.FP8:
            from .dequant import deepseek_block  # a file from_pretrained refuses: no torch, only this pure function

            if deepseek_block(w) is not None:
                effect = "; convert refuses it unless told to follow DeepSeek's reference (convert --fp8-reference deepseek)"
        name = w.storage["scale"] if w.scheme.family == model.FP8 else next(iter(w.storage.values()))
        t = by.get(name)
        out.append(
            Finding(
                "quant-scale-shape",
                _FP8_SEVERITY[kind],
                text + effect,
                tensor=name,
                file=(t.file if t is not None else w.file) or None,
                actual=str(list(t.shape)) if t is not None else None,
            )
        )
    return out


def _expected_dtypes(w: LogicalWeight) -> dict[str, frozenset[str]]:
    s = w.scheme
    if s.family == model.FP8:  # float32 scales (DeepSeek V3), or UE8M0: float8_e8m0fnu, or uint8 bytes (MXFP8)
        return {"scale": frozenset({"float32", "float8_e8m0fnu", "uint8"})}
    if s.family == model.COMPRESSED:
        return {"scale": frozenset({"float32", "float16", "bfloat16"})}
    if s.family == model.PACKED:
        return {
            "packed": frozenset({"int32"}),
            "scale": frozenset({"float32", "float16", "bfloat16"}),
            "shape": frozenset({"int64", "int32"}),
        }
    if s.family == model.NVFP4:
        return {"packed": frozenset({"uint8"}), "scale": frozenset(FLOAT8 & {"float8_e4m3fn"}), "global_scale": frozenset({"float32"})}
    if s.family == model.MXFP4:
        return {"scale": frozenset({"uint8", "float8_e8m0fnu"})}
    if s.family in (model.GPTQ, model.AWQ):
        return {
            "qweight": frozenset({"int32"}),
            "zero": frozenset({"int32"}),
            "scale": frozenset({"float16", "bfloat16", "float32"}),
            "g_idx": frozenset({"int32", "int64"}),
        }
    if s.family == model.BNB8:
        return {"scale": frozenset({"float32"})}
    if s.family == model.BNB4:
        absmax = frozenset({"uint8"}) if s.params.get("nested") else frozenset({"float32"})
        return {"absmax": absmax, "quant_map": frozenset({"float32"})}
    return {}


def scale_dtypes(inv: Inventory, quant: QuantView) -> list[Finding]:
    """Storage in a dtype the scheme's loader does not allocate: it casts on load (a scale already rounded to
    half precision stays rounded) or reinterprets packed integers."""
    by = inv.by_name()
    out = []
    for w in quant.weights:
        for role, allowed in _expected_dtypes(w).items():
            t = by.get(w.storage.get(role, ""))
            if t is None or t.dtype in allowed:
                continue
            out.append(
                Finding(
                    "quant-scale-dtype",
                    "warning",
                    # the tensor is the finding's subject, not in its words: one cause is one row of the report
                    f"is {t.dtype}; {_LOADER.get(w.scheme.family, 'the loader')} expects {' or '.join(sorted(allowed))} "
                    f"for the {role} of {w.scheme.name} and casts or misreads it",
                    tensor=t.name,
                    file=t.file or None,
                    expected=tuple(sorted(allowed)),
                    actual=t.dtype,
                )
            )
    return out


def ignored_modules(inv: Inventory, quant: QuantView) -> list[Finding]:
    """Modules the config keeps unquantized (``ignore`` / ``modules_to_not_convert``) whose tensors are quantized,
    and for transformers' ``fp8`` the reverse: a Linear its quantizer replaces, stored unquantized. Warnings: the
    config and the tensors disagree, yet transformers dequantizing FP8 on CPU loads both as the tensors say
    (tests/test_quant_scan.py loads them)."""
    if not quant.config:
        return []
    out = []
    for w in quant.weights:
        if kept_unquantized(w.module, quant.config) and w.storage.keys() != {"weight"}:  # not a bare float8 weight
            listed = "ignore" if quant.method == "compressed-tensors" else "modules_to_not_convert"
            out.append(
                Finding(
                    "quant-ignored-module",
                    "warning",
                    f"{w.module} is listed in quantization_config.{listed} but stored {w.scheme.name}: the config and the "
                    "tensors disagree on what this layer is (transformers dequantizing FP8 on CPU dequantizes it anyway; "
                    "a loader that honours the list builds a plain layer for the quantized values)",
                    tensor=w.name,
                    file=w.file or None,
                )
            )
    if quant.method == "fp8":
        names = {w.name for w in quant.weights}
        # A Linear: by its module type where known, else by its name, repeated elsewhere quantized (layer 1's up_proj)
        patterns = {_LAYER_NUMBER.sub(".#.", n) for n in names}
        for t in inv.tensors:
            module = t.name[: -len(".weight")]
            if (
                t.name.endswith(".weight")
                and t.name not in names
                and len(t.shape) == 2
                and (t.module_guess == "Linear" or (t.module or "").endswith("Linear") or _LAYER_NUMBER.sub(".#.", t.name) in patterns)
                and t.dtype not in FLOAT8
                and not kept_unquantized(module, quant.config)
                and not _output_embedding(module)
            ):
                out.append(
                    Finding(
                        "quant-ignored-module",
                        "warning",
                        f"{module} is stored {t.dtype}, but quantization_config (fp8) quantizes every Linear not in "
                        "modules_to_not_convert: FP8Linear (the GPU path) allocates a float8 weight and a weight_scale_inv "
                        "this checkpoint does not hold (transformers dequantizing on CPU loads it as stored)",
                        tensor=t.name,
                        file=t.file or None,
                    )
                )
    return out


_LAYER_NUMBER = re.compile(r"\.\d+\.")


def _output_embedding(module: str) -> bool:
    # get_keys_to_not_convert keeps the output embedding (lm_head) unquantized whatever the config lists
    return module.rsplit(".", 1)[-1] in ("lm_head", "embed_out", "output")


def config_contradictions(inv: Inventory, quant: QuantView) -> list[Finding]:
    """A quantization_config whose method or parameters the tensors contradict."""
    if not quant.config:
        return []
    method = quant.method
    out = []
    families = _METHOD_FAMILIES.get(method or "")
    if not quant.weights:
        out.append(
            Finding(
                "quant-config-mismatch",
                "error",
                f"config.json has a quantization_config ({method}) but no tensor is stored quantized; "
                "the loader would build quantized layers and find none of their tensors",
                file="config.json",
            )
        )
        return out
    if families is not None:
        wrong = [w for w in quant.weights if w.scheme.family not in families]
        for w in wrong[:1]:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            out.append(
                Finding(
                    "quant-config-mismatch",
                    "error",
                    f"config.json says quant_method {method}, but {w.name}{more} is stored {w.scheme.name}; that loader does not read it",
                    tensor=w.name,
                    file="config.json",
                )
            )
    if method in ("gptq", "awq"):
        bits = quant.config.get("bits", quant.config.get("w_bit"))
        by = inv.by_name()
        for w in quant.weights:
            zeros, scales = by.get(w.storage.get("zero", "")), by.get(w.storage.get("scale", ""))
            if zeros is None or scales is None or len(zeros.shape) != 2 or len(scales.shape) != 2 or not scales.shape[1]:
                continue
            stored = zeros.shape[1] * 32 // scales.shape[1]
            if isinstance(bits, int) and stored != bits:
                out.append(
                    Finding(
                        "quant-config-mismatch",
                        "error",
                        f"config.json says {bits}-bit, but {zeros.name} packs {stored}-bit zero points",
                        tensor=w.name,
                        file="config.json",
                    )
                )
    return out


QUANT_CHECKS: tuple[Callable[[Inventory, QuantView], list[Finding]], ...] = (
    missing_parts,
    scale_shapes,
    loader_readings,
    scale_dtypes,
    ignored_modules,
    config_contradictions,
)


def quant_consistency(inv: Inventory) -> list[Finding]:
    """Every quantization consistency finding for ``inv``; none for an unquantized checkpoint."""
    quant = view(inv)
    if not quant and not quant.config and "quantization_config" not in inv.metadata:
        return []
    out: list[Finding] = []
    for c in QUANT_CHECKS:
        out.extend(c(inv, quant))
    return out
