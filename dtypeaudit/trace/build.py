"""The model to trace, built without allocating weights: a factory or a Hugging Face config on the meta device,
each parameter and buffer given the dtype a checkpoint stores, then turned into fake tensors.

The model reference is resolved by ``formats.factory.resolve``, the one resolver every command uses (``scan
--model`` and ``convert --model`` take the same forms). Checkpoint dtypes come from dtypeaudit's own readers: no
tensor bytes, no checkpoint code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import UsageError
from ..inventory import Finding, Inventory, TensorRecord
from ..structure import type_name

if TYPE_CHECKING:
    import torch

    from ..formats.factory import ResolvedModel


def torch_dtype(spelling: str, what: str) -> torch.dtype:
    import torch

    name = dtypes.canonical(spelling)
    value = getattr(torch, name, None) if name else None
    if not isinstance(value, torch.dtype):
        raise UsageError(f"{what}: unknown dtype '{spelling}' (use float32, float16, bfloat16, float64, int64, fp16, bf16 ...)")
    return value


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.set_default_dtype`` for the build and the run, restored afterwards."""
    import torch

    if dtype is None:
        yield
        return
    if not dtype.is_floating_point:
        raise UsageError(f"--default-dtype must be a floating dtype, not {str(dtype).removeprefix('torch.')}")
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(target: str) -> ResolvedModel:
    """The model ``target`` names, as every command resolves it (``formats.factory.resolve``)."""
    from ..formats import factory

    return factory.resolve(target)


# -- the checkpoint's dtypes -----------------------------------------------------------------------


def model_inventory(model: Any, path: str) -> Inventory:
    """The model's parameters and buffers as records, for name matching (and the report's tensor list)."""
    owners = {name: type_name(type(m)) for name, m in model.named_modules()}
    records: list[TensorRecord] = []
    storage: dict[int, str] = {}
    for kind, items in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, t in items:
            if t is None:
                continue
            key = storage.setdefault(id(t), str(len(storage)))
            records.append(
                TensorRecord(
                    name=name,
                    dtype=dtypes.name_of(t.dtype),
                    shape=tuple(t.shape),
                    nbytes=t.numel() * t.element_size(),
                    kind=kind,  # type: ignore[arg-type]
                    storage=key,
                    module=owners.get(name.rpartition(".")[0]),
                )
            )
    from ..inventory import link_shared_storage

    return Inventory(path, "trace", link_shared_storage(records), (), {"model_class": type(model).__name__})


def checkpoint_dtypes(model: Any, checkpoint: str) -> tuple[dict[str, str], list[Finding]]:
    """Model tensor name -> the dtype the checkpoint stores for it, as ``load_state_dict(assign=True)`` would leave it.

    Names are matched as ``scan --model`` matches them (``factory.match_names``: wrapper prefixes such as
    ``module.`` or ``model_state_dict.``, and prefixes most names share). A checkpoint that matches fewer than
    half of the model's tensors is refused; model tensors the checkpoint lacks keep the factory's dtype and are
    reported (``checkpoint-missing``), since ``load_state_dict(strict=True)`` would refuse such a checkpoint.
    """
    from ..formats import factory, read_checkpoint

    ckpt = read_checkpoint(checkpoint)
    if any(f.severity == "error" for f in ckpt.findings):
        bad = next(f for f in ckpt.findings if f.severity == "error")
        raise UsageError(f"--checkpoint {checkpoint}: {bad.rule}: {bad.message}; `dtypeaudit scan` shows every finding")
    mine = model_inventory(model, "model")
    mapping = factory.match_names(ckpt, mine)
    if not mapping.matched or len(mapping.matched) * 2 < mapping.total:
        text = (
            f"--checkpoint {checkpoint} does not fit the model: {len(mapping.matched)} of its {mapping.total} model tensors "
            "match a name and shape of the model"
        )
        if mapping.example:
            text += f" (checkpoint names look like '{mapping.example[0]}', the model's like '{mapping.example[1]}')"
        raise UsageError(text)
    stored = {t.name: t.dtype for t in ckpt.tensors}
    out = {model_name: stored[ckpt_name] for ckpt_name, model_name in mapping.matched.items()}
    persistent = set(model.state_dict(keep_vars=True))
    covered_storage = {t.storage for t in mine.tensors if t.name in out}
    missing = [t for t in mine.tensors if t.name not in out and t.name in persistent and t.storage not in covered_storage]
    findings = [
        Finding(
            "checkpoint-missing",
            "warning",
            f"not in {checkpoint}: it keeps the factory's dtype {t.dtype}; load_state_dict(strict=True) would refuse this checkpoint",
            tensor=t.name,
        )
        for t in missing
    ]
    return out, findings


# -- meta to fake ----------------------------------------------------------------------------------


def fakeify(model: Any, fake_mode: Any, device: str, dtypes_by_name: dict[str, str]) -> None:
    """Replace every parameter, buffer and tensor attribute with a fake tensor on ``device``, in the dtype
    ``dtypes_by_name`` gives (else its own). Tied parameters stay one tensor."""
    import torch

    converter = fake_mode.fake_tensor_converter
    target = torch.device(device)
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None:
            names.setdefault(id(t), []).append(name)
    memo: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if id(t) in memo:
            return memo[id(t)]
        dtype = t.dtype
        for n in names.get(id(t), ()):
            if n in dtypes_by_name:
                dtype = getattr(torch, dtypes_by_name[n], dtype)
                break
        base = t.detach()
        if base.device.type != "meta":
            base = base.to("meta")
        if base.dtype != dtype:
            base = base.to(dtype)
        out = converter.from_meta_and_device(fake_mode, base, target)
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad and out.is_floating_point())
        memo[id(t)] = out
        return out

    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = fake(p)
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = fake(b)
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not key.startswith("_"):
                setattr(module, key, fake(value))
