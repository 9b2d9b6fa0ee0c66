"""``dtypeaudit trace``: the dtype of every operation of a forward (and backward) pass, predicted on fake tensors.

The flow: factory or Hugging Face config -> model on the meta device (``build``), the checkpoint's dtypes
applied -> fake tensors -> one run under a recorder (``record``) -> findings and a per-module summary
(``checks``) -> the same ``Report`` that ``scan`` makes, with a ``trace`` section.

    from dtypeaudit.trace import trace
    report = trace("mymodels/net.py:build", inputs=["8x3x224x224:float16"], backward=True)
    summary = report.checkpoints[0].trace          # TraceSummary: ops, modules, activations, grads
    report = trace("mymodels/net.py:build", policy="release.yaml", target="t4")   # trace:, fail_on, target:

A policy gives the trace its ``trace:`` section (``fail_on``, ``allow_promotion``), its ``fail_on`` and its
``target:``; explicit arguments win over it. Its tensor rules are for ``scan`` and ``audit``.

The factory the user names runs (it is their code); nothing from a checkpoint does. torch is imported here
only inside functions, so ``import dtypeaudit`` and ``dtypeaudit scan`` never load it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import UsageError
from ..inventory import Finding, Report, Severity
from ..options import effective
from . import verdicts
from .record import LOSSES, TraceStopped
from .result import TraceCheckpointReport, TraceSummary

if TYPE_CHECKING:
    from ..hardware import Target
    from ..policy import Matcher, Policy

AUTOCAST_DTYPES = {"float16": "float16", "bfloat16": "bfloat16"}
DEVICES = ("cpu",)

__all__ = ["trace", "trace_module", "TraceStopped", "TraceSummary", "TraceCheckpointReport", "LOSSES", "DEVICES"]


def trace(
    model: str,
    *,
    inputs: Sequence[str] = (),
    input_factory: str | None = None,
    checkpoint: str | None = None,
    autocast: str | None = None,
    backward: bool = False,
    loss: str = "auto",
    default_dtype: str | None = None,
    device: str = "cpu",
    allow_promotion: Sequence[str] = (),
    fail_on: Severity | None = None,
    policy: Policy | str | None = None,
    target: Target | str | None = None,
) -> Report:
    """Build the model ``model`` names (running its factory), apply ``checkpoint``'s dtypes, and trace it.

    ``policy`` (a ``Policy``, a file or a preset name) and ``target`` (a hardware target) are resolved before the
    factory runs. Raises ``DtypeAuditError`` (``FactoryError``, ``UsageError``, ``PolicyError``, ``TraceStopped``,
    ``CheckpointError``) for input that cannot be traced; everything about dtypes is a finding in the report.
    """
    from .build import build, checkpoint_dtypes, torch_dtype
    from .build import default_dtype as default_dtype_ctx

    chosen = effective(policy, target=target)
    dd = torch_dtype(default_dtype, "--default-dtype") if default_dtype else None
    with default_dtype_ctx(dd):
        built = build(model)
        applied: dict[str, str] = {}
        found: list[Finding] = []
        source = checkpoint or built.weights
        if source:
            applied, found = checkpoint_dtypes(built.model, source)
        return trace_module(
            built.model,
            name=model,
            source=built.source,
            inputs=inputs,
            input_factory=input_factory,
            checkpoint=source,
            checkpoint_dtypes=applied,
            extra_findings=found,
            autocast=autocast,
            backward=backward,
            loss=loss,
            device=device,
            allow_promotion=allow_promotion,
            fail_on=fail_on,
            policy=chosen.policy,
            target=chosen.target,
        )


def trace_module(
    model: Any,
    *,
    name: str | None = None,
    source: str = "factory",
    inputs: Sequence[str] = (),
    input_factory: str | None = None,
    checkpoint: str | None = None,
    checkpoint_dtypes: dict[str, str] | None = None,
    extra_findings: Sequence[Finding] = (),
    autocast: str | None = None,
    backward: bool = False,
    loss: str = "auto",
    device: str = "cpu",
    allow_promotion: Sequence[str] = (),
    fail_on: Severity | None = None,
    policy: Policy | str | None = None,
    target: Target | str | None = None,
) -> Report:
    """Trace a model that is already built (on the meta device, or anywhere: its tensors become fake ones).

    The model's parameters and buffers are replaced by fake tensors in place. The run fails at ``fail_on``, else the
    policy's ``trace: fail_on``, else its ``fail_on``, else ``error``; ``allow_promotion`` adds to the policy's
    ``trace: allow_promotion``; ``target`` replaces the policy's ``target:``.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import inputs as inputs_mod
    from . import record
    from .build import fakeify, model_inventory

    if device not in DEVICES:
        raise UsageError(f"--device {device}: traces follow the kernels and autocast rules of {', '.join(DEVICES)}")
    if loss not in LOSSES:
        raise UsageError(f"--loss must be one of {', '.join(LOSSES)}, not '{loss}'")
    ac = None
    if autocast is not None:
        from ..dtypes import canonical

        ac_name = AUTOCAST_DTYPES.get(canonical(autocast) or "")
        if ac_name is None:
            raise UsageError(f"--autocast must be fp16 or bf16, not '{autocast}'")
        ac = getattr(torch, ac_name)
    if inputs and input_factory:
        raise UsageError("give --input or --input-factory, not both")
    chosen = effective(policy, target=target, fail_on=fail_on)
    pol, hardware = chosen.policy, chosen.target
    severity = chosen.trace_fail_on
    allowed = _matchers(allow_promotion, pol.trace.allow_promotion if pol is not None else ())
    label = name or type(model).__name__
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakeify(model, fake_mode, device, checkpoint_dtypes or {})
    model.train(backward)
    with fake_mode:
        if input_factory:
            args, kwargs, records = inputs_mod.from_factory(input_factory)
        else:
            specs = [inputs_mod.parse(s) for s in inputs] or inputs_mod.default_specs(model, source)
            args, kwargs, records = inputs_mod.make(specs, dtypes.name_of(torch.get_default_dtype()))
        if backward and loss == "auto" and source == "transformers":
            inputs_mod.add_labels(model, kwargs)
        grad = contextlib.nullcontext() if backward else torch.no_grad()
        with grad:
            rec = record.run(model, args, kwargs, autocast=ac, device=device, backward=backward, loss=loss, probe=True)
    modules, activations, copies = verdicts.summarize(rec.ops, rec.calls, list(rec.types), rec.types)
    summary = TraceSummary(
        model=type(model).__name__,
        device=device,
        autocast=dtypes.name_of(ac) if ac is not None else None,
        backward=backward,
        default_dtype=dtypes.name_of(torch.get_default_dtype()),
        checkpoint=checkpoint,
        inputs=records,
        output=rec.output,
        loss=rec.loss,
        loss_dtype=rec.loss_dtype,
        stopped=rec.stopped,
        ops=tuple(rec.ops),
        calls=tuple(rec.calls),
        modules=modules,
        activations=activations,
        grads=tuple(rec.grads),
        autocast_copies=copies,
    )
    found = [
        *extra_findings,
        *verdicts.findings(
            rec.ops,
            grads=rec.grads,
            loss=rec.loss,
            loss_dtype=rec.loss_dtype,
            stopped=rec.stopped,
            stopped_module=rec.stopped_module,
            allow_promotion=allowed,
            autocast=summary.autocast,
        ),
    ]
    inventory = model_inventory(model, label)
    if hardware is not None:
        from ..hardware import target_findings

        found += verdicts.target_findings(rec.ops, hardware)
        found += target_findings(inventory, hardware)  # parameters and buffers live on the device too
    metadata = {**inventory.metadata, "device": device, "autocast": summary.autocast, "backward": backward}
    inventory = type(inventory)(inventory.path, "trace", inventory.tensors, (), metadata)
    report = TraceCheckpointReport(label, "trace", None, inventory, tuple(found), trace=summary)
    return Report((report,), fail_on=severity, policy=pol.source if pol is not None else None)


def _matchers(patterns: Sequence[str], from_policy: Sequence[Matcher] = ()) -> Callable[[str], bool] | None:
    """Whether a module's implicit promotion is meant: one of the patterns matches its path, or ``(root)`` for the model."""
    if not patterns and not from_policy:
        return None
    from ..policy import compile_matcher

    compiled = list(from_policy)
    for p in patterns:
        try:
            compiled.append(compile_matcher(p))
        except ValueError as exc:
            raise UsageError(f"--allow-promotion '{p}': {exc}") from None
    return lambda module: any(m(module) or m(verdicts.where(module)) for m in compiled)
