"""The model and inputs a tune runs on, as the ``dtypeaudit tune`` command names them.

The model: a factory (``file.py:func``, ``package.module:func``) called for real on the CPU, or a Hugging Face
folder built with its class by ``from_pretrained`` (weights from the folder, in float32, no remote code). The
factory's initial values are replaced by ``--checkpoint``'s: a safetensors file, or a torch.save file read with
``torch.load(weights_only=True)``; no code from a checkpoint ever runs. Names are matched as ``scan --model`` and
``trace --checkpoint`` match them (``factory.match_names``: wrapper prefixes, shared prefixes).

The inputs: a factory (``--input-factory``, as ``trace`` calls it), a file of tensors (``--inputs``), or
``SHAPE[:DTYPE]`` specs (``--input``) filled with seeded random data, with a note that real data is better.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FactoryError, UsageError

if TYPE_CHECKING:
    import torch

    from .result import TuneResult

RANDOM_NOTE = "inputs are seeded random data (--input); a real batch (--input-factory, --inputs) finds what real data does"
SEED = 0


def load_model(reference: str, checkpoint: str | None = None) -> torch.nn.Module:
    """The model ``reference`` names, with real float32 values (``checkpoint``'s where given), in eval mode."""
    import torch

    from ..formats import factory

    if factory.is_hf_reference(reference):
        model = _hf_model(reference)
    elif factory.looks_like_factory(reference):
        model = _call_factory(reference)
    else:
        factory.resolve(reference)  # says, in the resolver's words, why this is not a model
        raise FactoryError(f"is not a model: give {factory.FORMS}", path=reference)
    if checkpoint is not None:
        load_weights(model, checkpoint)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise UsageError(f"{reference} built its model on the meta device: give --checkpoint with its weights")
    return model.to(torch.float32).eval()


def _call_factory(reference: str) -> torch.nn.Module:
    import torch

    from ..formats import factory
    from .user import user_callable

    fn = user_callable(reference, "the model")
    attr = reference.rpartition(":")[2]
    try:
        value = fn()  # for real, on the CPU: a tune runs the model
    except Exception as exc:
        raise FactoryError(f"calling '{attr}()' failed: {type(exc).__name__}: {exc}", path=reference) from None
    if isinstance(value, torch.nn.Module):
        return value
    built = factory.resolve(reference).model  # a Hugging Face config: its class, as every command resolves it
    return type(built)(value)


def _hf_model(reference: str) -> torch.nn.Module:
    import torch

    from ..formats import factory

    resolved = factory.resolve(reference)
    if resolved.weights is None:
        raise UsageError(f"{reference}: a Hugging Face folder without weights; give one with its weights, or a factory and --checkpoint")
    cls = type(resolved.model)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar on stderr is not our progress
    try:
        # from_pretrained reads safetensors, or .bin with torch.load(weights_only=True); trust_remote_code stays off.
        return cls.from_pretrained(resolved.weights, torch_dtype=torch.float32, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise FactoryError(f"from_pretrained failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", path=reference) from None


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key path -> tensor, for the nested dicts and lists of a torch.save file (as the readers name them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def read_tensors(path: str) -> Any:
    """A safetensors file (a dict of tensors) or a torch.save file read with ``weights_only=True``."""
    import torch

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    if file.read_bytes()[8:9] == b"{":  # a safetensors header follows its 8-byte length
        from safetensors.torch import load_file

        return load_file(str(file))
    try:
        return torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(f"{path}: not a file of tensors torch.load(weights_only=True) reads ({type(exc).__name__}: {exc})") from None


def load_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """Replace the model's values with ``checkpoint``'s, names matched as ``scan --model`` matches them."""
    import torch

    from ..formats import factory, read_checkpoint
    from ..trace.build import model_inventory

    ckpt = read_checkpoint(checkpoint)
    mapping = factory.match_names(ckpt, model_inventory(model, "model"))
    if not mapping.matched or len(mapping.matched) * 2 < mapping.total:
        raise UsageError(
            f"--checkpoint {checkpoint} does not fit the model: {len(mapping.matched)} of its {mapping.total} model tensors "
            "match a name and shape of the model"
        )
    values = _flatten(read_tensors(checkpoint))
    state = {
        model_name: values[ckpt_name].float() if values[ckpt_name].is_floating_point() else values[ckpt_name]
        for ckpt_name, model_name in mapping.matched.items()
        if ckpt_name in values
    }
    with torch.no_grad():
        model.load_state_dict(state, strict=False, assign=True)


def load_inputs(
    model: torch.nn.Module, *, input_factory: str | None = None, inputs_file: str | None = None, specs: Sequence[str] = ()
) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], tuple[str, ...]]:
    """``((args, kwargs), notes)``: exactly one of ``input_factory``, ``inputs_file`` and ``specs``."""
    import torch

    from ..trace import inputs as trace_inputs
    from .search import split_inputs

    given = [x for x in (input_factory, inputs_file, list(specs) or None) if x]
    if len(given) != 1:
        raise UsageError("give the model's input once: --input-factory file.py:func, --inputs FILE or --input SHAPE[:DTYPE]")
    if input_factory:
        args, kwargs, _ = trace_inputs.from_factory(input_factory)
        return (args, kwargs), ()
    if inputs_file:
        value = read_tensors(inputs_file)
        if isinstance(value, dict) and value and all(k.isdigit() for k in value):
            value = tuple(value[k] for k in sorted(value, key=int))  # a safetensors file of positional tensors
        return split_inputs(value), ()
    generator = torch.Generator().manual_seed(SEED)
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 100)
    args_list: list[Any] = []
    named: dict[str, Any] = {}
    for text in specs:
        spec = trace_inputs.parse(text)
        dtype = getattr(torch, trace_inputs.dtype_for(spec, "float32"))
        if dtype.is_floating_point:
            t = torch.randn(spec.shape, generator=generator).to(dtype)
        elif dtype == torch.bool:
            t = torch.ones(spec.shape, dtype=torch.bool)
        else:
            high = 2 if spec.name and "mask" in spec.name else vocab
            t = torch.randint(0, high, spec.shape, generator=generator, dtype=dtype)
        if spec.name:
            named[spec.name] = t
        else:
            args_list.append(t)
    return (tuple(args_list), named), (RANDOM_NOTE,)


def tune_from(
    reference: str,
    *,
    to: str,
    checkpoint: str | None = None,
    input_factory: str | None = None,
    inputs_file: str | None = None,
    specs: Sequence[str] = (),
    tolerance: float | None = None,
    metric: str = "max-abs-rel",
    progress: Any = None,
) -> TuneResult:
    """What ``dtypeaudit tune MODEL`` does before it renders: the model and inputs as the command names them, tuned.

    Raises ``DtypeAuditError`` (``UsageError``, ``FactoryError``, ``CheckpointError``) for input that cannot be tuned
    (exit 2); the command exits 0 when ``TuneResult.passed``, else 1.
    """
    from .search import tune

    model = load_model(reference, checkpoint)
    inputs, notes = load_inputs(model, input_factory=input_factory, inputs_file=inputs_file, specs=specs)
    return tune(model, inputs, to=to, tolerance=tolerance, metric=metric, progress=progress, notes=notes)
