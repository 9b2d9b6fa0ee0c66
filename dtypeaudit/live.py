"""Audit objects in memory: a model, an optimizer, a GradScaler, a batch, or a dict of them.

``audit`` builds the same ``Inventory`` of ``TensorRecord``s the readers build, from each tensor's metadata
only (dtype, shape, strides, device; never its data, so CUDA and meta tensors cost the same), and runs the
same checks as ``check``:

- a module's parameters and buffers, with their true kinds and the type of the module that owns them, named
  as ``state_dict()`` names them: ``check`` runs on them as on a checkpoint read with ``--model``;
- an optimizer's state (region ``optimizer``), named after the parameters of a module audited alongside
  (``opt.state.fc.weight.exp_avg``), else by position (``opt.state.0.exp_avg``), and tensors in its
  ``param_groups``;
- a GradScaler's ``scale`` and ``growth_tracker`` (region ``optimizer``, once it has scaled a loss);
- anything else is a batch: tensors in any nesting of dicts, lists, tuples and dataclasses. A batch is held to
  the policy and the target, not to the module-structure checks (its names are not a module's), and its
  floating tensors are compared with the first layer of a module audited alongside (``batch-dtype``).

``torch.get_default_dtype()`` is recorded (``metadata["default_dtype"]``); a policy's ``default_dtype:``
requires it (``default-dtype``). An ``Auditor`` remembers the dtypes of the last audit and reports tensors
whose dtype changed since (``dtype-drift``): half-applied ``.to()`` calls, optimizers that rewrite parameters.
"""

from __future__ import annotations

import dataclasses
import io
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .checks import check, policy_findings
from .errors import DtypeAuditError
from .inventory import Finding, Inventory, Severity, TensorRecord, link_shared_storage, severity_rank

if TYPE_CHECKING:
    from .policy import Policy
    from .render.humanize import FindingGroup
    from .targets import Target

LIVE_FORMAT = "live"
# Lightning wraps optimizers in LightningOptimizer (``_optimizer``), Accelerate in AcceleratedOptimizer (``optimizer``).
_OPTIMIZER_WRAPPERS = ("_optimizer", "optimizer")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FirstLayer:
    """The first module of an audited model that holds floating parameters: what the batch meets first."""

    name: str
    """Its name in the model (``conv1``, ``model.embed_tokens``)."""
    type_name: str
    dtype: str
    """The dtype of its weight (or first floating parameter)."""


@dataclass(frozen=True)
class LiveInventory:
    """What ``collect`` found: the inventory of every tensor and which of them form the batch."""

    inventory: Inventory
    """Every tensor: modules, optimizer state, scaler, batch."""
    batch: frozenset[str] = frozenset()
    """Names of the batch's tensors."""
    first_layer: FirstLayer | None = None
    """The first layer of the (first) module audited, if any."""

    def part(self, batch: bool) -> Inventory:
        """The batch's tensors (``batch=True``), or everything else."""
        inv = self.inventory
        return replace(inv, tensors=tuple(t for t in inv.tensors if (t.name in self.batch) == batch))


@dataclass
class _Collector:
    records: list[TensorRecord] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)
    param_names: dict[int, str] = field(default_factory=dict)
    devices: Counter[str] = field(default_factory=Counter)
    frozen: int = 0
    first_layer: FirstLayer | None = None

    def add(self, name: str, t: Any, *, kind: str = "unknown", region: str = "model", module: str | None = None) -> None:
        """One tensor, from its metadata: no element is read or copied, whatever its device."""
        device = t.device.type
        layout = str(t.layout).removeprefix("torch.")
        try:
            stride: tuple[int, ...] | None = tuple(t.stride())
        except (RuntimeError, NotImplementedError):  # sparse layouts have no strides
            stride = None
        if getattr(t, "is_quantized", False):
            layout = "quantized"
        storage = f"id:{id(t)}"
        if device != "meta" and layout == "strided":
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one storage
                ptr = 0
            if ptr:
                storage = f"{device}:{ptr}"
        self.records.append(
            TensorRecord(
                name=name,
                dtype=_dtype_name(t.dtype),
                shape=tuple(t.shape),
                nbytes=t.numel() * t.element_size(),
                kind=kind,  # type: ignore[arg-type]
                storage=storage,
                offset=_offset(t),
                stride=stride,
                layout=layout,
                region=region,  # type: ignore[arg-type]
                module=module,
            )
        )
        self.devices[device] += 1
        if getattr(t, "requires_grad", False) is False and kind == "parameter":
            self.frozen += 1


def _offset(t: Any) -> int:
    try:
        return int(t.storage_offset())
    except (RuntimeError, NotImplementedError):
        return 0


def _join(prefix: str, name: object) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _module(c: _Collector, prefix: str, m: Any) -> None:
    owners = {name: type(sub).__name__ for name, sub in m.named_modules(remove_duplicate=False)}
    for name, p in m.named_parameters(remove_duplicate=False):
        full = _join(prefix, name)
        c.param_names.setdefault(id(p), full)
        c.add(full, p, kind="parameter", module=owners.get(name.rpartition(".")[0]))
    for name, b in m.named_buffers(remove_duplicate=False):
        c.add(_join(prefix, name), b, kind="buffer", module=owners.get(name.rpartition(".")[0]))
    if c.first_layer is None:
        c.first_layer = first_layer(m, prefix)


def first_layer(m: Any, prefix: str = "") -> FirstLayer | None:
    """The first submodule, in registration order, that holds a floating parameter of its own."""
    for name, sub in m.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.dtype.is_floating_point]
        if own:
            weight = next((p for n, p in own if n == "weight"), own[0][1])
            return FirstLayer(_join(prefix, name) or type(sub).__name__, type(sub).__name__, _dtype_name(weight.dtype))
    return None


def _optimizer(c: _Collector, prefix: str, opt: Any) -> None:
    index = 0
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            pname = c.param_names.get(id(p), str(index))
            index += 1
            for key, value in opt.state.get(p, {}).items():
                if _is_tensor(value):
                    c.add(_join(prefix, f"state.{pname}.{key}"), value, region="optimizer")
        for key, value in group.items():
            if key != "params" and _is_tensor(value):
                c.add(_join(prefix, f"param_groups.{g}.{key}"), value, region="optimizer")


def _scaler(c: _Collector, prefix: str, scaler: Any) -> None:
    for attr, name in (("_scale", "scale"), ("_growth_tracker", "growth_tracker")):
        value = getattr(scaler, attr, None)
        if _is_tensor(value):
            c.add(_join(prefix, name), value, region="optimizer")


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _batch(c: _Collector, prefix: str, obj: Any, depth: int = 0) -> None:
    if depth > 64:
        return
    if _is_tensor(obj):
        name = prefix or "batch"
        c.add(name, obj)
        c.batch.append(name)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _batch(c, _join(prefix, k), v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        fields = getattr(obj, "_fields", None)  # a namedtuple: its field names
        for i, v in enumerate(obj):
            _batch(c, _join(prefix, fields[i] if fields else i), v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _batch(c, _join(prefix, f.name), getattr(obj, f.name, None), depth + 1)


def _kind_of(obj: Any) -> str:
    """``module``, ``optimizer``, ``scaler`` or ``batch``."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer) or any(isinstance(getattr(obj, a, None), torch.optim.Optimizer) for a in _OPTIMIZER_WRAPPERS):
        return "optimizer"
    if isinstance(obj, torch.amp.GradScaler):
        return "scaler"
    return "batch"


def _unwrap_optimizer(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.optim.Optimizer):
        return obj
    return next(getattr(obj, a) for a in _OPTIMIZER_WRAPPERS if isinstance(getattr(obj, a, None), torch.optim.Optimizer))


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """``(name prefix, object)`` pairs: a dict's values under their keys, anything else under no prefix."""
    if isinstance(obj, Mapping) and any(_kind_of(v) != "batch" for v in obj.values()):
        return [(str(k), v) for k, v in obj.items()]
    return [("", obj)]


def collect(obj: Any, *, label: str | None = None, parts: Iterable[tuple[str, Any]] | None = None) -> LiveInventory:
    """Every tensor of ``obj`` (see the module's docstring), read from metadata only.

    ``parts`` gives ``(prefix, object)`` pairs directly (the callbacks name a model's tensors without a prefix,
    its optimizer's under ``optimizer.``); otherwise a dict that holds a module, optimizer or scaler is split
    into its values, and anything else is one object.
    """
    import torch

    items = list(parts) if parts is not None else _parts(obj)
    kinds = [(_kind_of(o), p, o) for p, o in items]
    c = _Collector()
    # Modules first, so that optimizer state can be named after their parameters.
    order = {"module": 0, "optimizer": 1, "scaler": 2, "batch": 3}
    for kind, prefix, o in sorted(kinds, key=lambda k: order[k[0]]):
        if kind == "module":
            _module(c, prefix, o)
        elif kind == "optimizer":
            _optimizer(c, prefix, _unwrap_optimizer(o))
        elif kind == "scaler":
            _scaler(c, prefix, o)
        else:
            _batch(c, prefix, o)
    metadata: dict[str, object] = {
        "default_dtype": _dtype_name(torch.get_default_dtype()),
        "devices": dict(c.devices),
        "objects": {p or "": k for k, p, _ in kinds},
    }
    if c.frozen:
        metadata["frozen_parameters"] = c.frozen
    if c.first_layer is not None:
        metadata["first_layer"] = dataclasses.asdict(c.first_layer)
    if label is None:
        label = describe(obj) if parts is None else "<" + ", ".join(f"{p or 'model'}: {type(o).__name__}" for p, o in items) + ">"
    inv = Inventory(label, LIVE_FORMAT, link_shared_storage(c.records), (), metadata)
    return LiveInventory(inv, frozenset(c.batch), c.first_layer)


def describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return "<" + ", ".join(f"{k}: {type(v).__name__}" for k, v in obj.items()) + ">"
    return f"<{type(obj).__name__}>"


def inventory(obj: Any, *, label: str | None = None) -> Inventory:
    """The inventory of every tensor in ``obj``: the same records ``read`` gives for a checkpoint, format ``live``."""
    return collect(obj, label=label).inventory


# -- checks that only a live object can fail --------------------------------------------------------------------


def default_dtype_findings(inv: Inventory, policy: Policy | None) -> list[Finding]:
    """``default-dtype``: torch's default dtype at audit time is not the one the policy's ``default_dtype:`` requires."""
    wanted = policy.default_dtype if policy is not None else None
    found = inv.metadata.get("default_dtype")
    if wanted is None or not isinstance(found, str) or found == wanted:
        return []
    return [
        Finding(
            "default-dtype",
            "error",
            f"torch.get_default_dtype() is {found}, but the policy requires {wanted}: layers built from now on, "
            f"torch.tensor(1.0) and torch.zeros(...) are {found} (a torch.set_default_dtype call changed it)",
            expected=(wanted,),
            actual=found,
        )
    ]


def batch_findings(live: LiveInventory) -> list[Finding]:
    """``batch-dtype``: floating batch tensors of another dtype than the first layer of the model they meet.

    Skipped when the first layer is an embedding: its input is integer ids, and the model's own code handles
    floating inputs such as masks.
    """
    first = live.first_layer
    if first is None or "Embedding" in first.type_name:
        return []
    out = []
    for t in live.inventory.tensors:
        if t.name not in live.batch or not _floating(t.dtype) or t.dtype == first.dtype:
            continue
        out.append(
            Finding(
                "batch-dtype",
                "warning",
                f"the batch holds {t.dtype} but the model's first layer {first.name} ({first.type_name}) is {first.dtype}: "
                f"a Linear or Conv fails on {t.dtype} input ('mat1 and mat2 must have the same dtype', 'expected scalar "
                f"type ... but found ...'), and a loss computed against a {t.dtype} target runs in the wider dtype; "
                f"cast the batch to {first.dtype} where it is loaded",
                tensor=t.name,
                expected=(first.dtype,),
                actual=t.dtype,
            )
        )
    return out


def _floating(dtype: str) -> bool:
    from .dtypes import DTYPES

    return dtype in DTYPES and DTYPES[dtype].is_floating


@dataclass(frozen=True)
class Snapshot:
    """The dtypes an audit saw, to compare the next audit with."""

    dtypes: Mapping[str, str]
    """Tensor name -> dtype, for the model's and optimizer's tensors (the batch changes every step)."""
    default_dtype: str | None
    label: str
    """When it was taken (``fit start``, ``epoch 0``)."""


def snapshot(live: LiveInventory, label: str = "the last audit") -> Snapshot:
    default = live.inventory.metadata.get("default_dtype")
    return Snapshot(
        {t.name: t.dtype for t in live.inventory.tensors if t.name not in live.batch},
        default if isinstance(default, str) else None,
        label,
    )


def drift_findings(before: Snapshot, after: Snapshot, *, severity: Severity = "warning") -> list[Finding]:
    """``dtype-drift``: every tensor present in both snapshots whose dtype changed, and a changed default dtype."""
    out = []
    for name, dtype in after.dtypes.items():
        old = before.dtypes.get(name)
        if old is not None and old != dtype:
            out.append(
                Finding(
                    "dtype-drift",
                    severity,
                    f"changed from {old} to {dtype} since {before.label}: a .to()/.half() applied to part of the model, "
                    "or an optimizer or hook that rewrites tensors",
                    tensor=name,
                    expected=(old,),
                    actual=dtype,
                )
            )
    if before.default_dtype and after.default_dtype and before.default_dtype != after.default_dtype:
        out.append(
            Finding(
                "dtype-drift",
                severity,
                f"torch.get_default_dtype() changed from {before.default_dtype} to {after.default_dtype} since {before.label}",
                expected=(before.default_dtype,),
                actual=after.default_dtype,
            )
        )
    return out


# -- audit ----------------------------------------------------------------------------------------------------------


def as_policy(policy: Policy | str | None) -> Policy | None:
    if policy is None or not isinstance(policy, str):
        return policy
    from .policy import load_policy

    return load_policy(policy)


def _resolve_target(target: Target | str | None, policy: Policy | None) -> Target | None:
    from .targets import resolve

    chosen = target if target is not None else (policy.target if policy is not None else None)
    if chosen is None:
        return None
    return resolve(chosen) if isinstance(chosen, str) else chosen


def findings_for(live: LiveInventory, policy: Policy | None = None, target: Target | None = None) -> list[Finding]:
    """Every finding for a collected object: ``check`` on its model and optimizer tensors, the policy on its batch,
    the target on everything, the batch against the first layer, the default dtype, and unused policy rules."""
    from .targets import target_findings

    model = live.part(batch=False)
    batch = live.part(batch=True)
    own_target = policy.target if policy is not None else None
    checked_policy = policy
    if policy is not None and own_target is not None and target is not None:
        checked_policy = replace(policy, target=None)  # an explicit target overrides the policy's
    out = check(model, checked_policy) if model.tensors or policy is not None else []
    if policy is not None and batch.tensors:
        out += policy_findings(batch, policy)
    if target is not None:
        out += target_findings(live.inventory, target)
    out += batch_findings(live)
    out += default_dtype_findings(live.inventory, policy)
    if policy is not None:
        out += policy.unused_rules([live.inventory])
    return list(dict.fromkeys(out))  # a check that runs twice (the policy's own target) reports once


class Findings(list[Finding]):
    """What ``audit`` returns: every finding, a list as before; ``groups``, ``str()`` and the repr put the findings
    that share a rule and a cause together (six ``emulated-dtype`` warnings about one cause are one line)."""

    @property
    def groups(self) -> list[FindingGroup]:
        from .render.humanize import group_findings

        return group_findings(self)

    def __str__(self) -> str:
        return render_findings(self, title="dtypeaudit.audit")

    def __repr__(self) -> str:
        if not self:
            return "Findings([])"
        rows = [f"{g.severity} {g.rule} ×{g.count} ({g.places()}): {g.message()}" for g in self.groups]
        return f"Findings({len(self)} findings, {len(rows)} cause{'s' if len(rows) != 1 else ''}: " + "; ".join(rows) + ")"


def audit(obj: Any, policy: Policy | str | None = None, *, target: Target | str | None = None) -> Findings:
    """Audit a live ``nn.Module``, optimizer, ``GradScaler``, batch, or a dict of them; see the module's docstring.

    ``policy`` is a ``Policy``, a preset name or a YAML file; ``target`` a hardware target (``v100``, ``mps``;
    ``dtypeaudit targets`` lists them), else the policy's ``target:``. Returns the same ``Finding`` objects as
    ``check``, in a ``Findings`` list whose ``groups`` (and printout) put those sharing a rule and a cause
    together. Reads metadata only: auditing a 7B model on the meta device takes milliseconds and no memory
    proportional to the model.
    """
    pol = as_policy(policy)
    live = collect(obj)
    return Findings(findings_for(live, pol, _resolve_target(target, pol)))


class Auditor:
    """Audits the same objects again and again, and reports what changed in between (``dtype-drift``).

    ``fail_on`` is the severity that makes ``enforce`` fail (default: the policy's, else ``error``), as for scan.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        target: Target | str | None = None,
        fail_on: Severity | None = None,
        drift_severity: Severity = "warning",
    ) -> None:
        self.policy = as_policy(policy)
        self.target = _resolve_target(target, self.policy)
        self.fail_on: Severity = fail_on or (self.policy.fail_on if self.policy and self.policy.fail_on else "error")
        self.drift_severity: Severity = drift_severity
        self.previous: Snapshot | None = None
        self.history: list[tuple[str, list[Finding]]] = []
        """``(label, findings)`` of every audit so far."""

    def audit(self, obj: Any = None, *, label: str = "the last audit", parts: Iterable[tuple[str, Any]] | None = None) -> list[Finding]:
        """Findings for ``obj`` now, plus ``dtype-drift`` against the previous audit; remembers this one as ``label``."""
        live = collect(obj, parts=parts)
        found = findings_for(live, self.policy, self.target)
        now = snapshot(live, label)
        if self.previous is not None:
            found += drift_findings(self.previous, now, severity=self.drift_severity)
        self.previous = now
        self.history.append((label, found))
        return found

    def failing(self, findings: Iterable[Finding]) -> list[Finding]:
        """The findings at or above ``fail_on``."""
        return [f for f in findings if severity_rank(f.severity) >= severity_rank(self.fail_on)]


# -- failing and telling --------------------------------------------------------------------------------------------


class AuditFailed(AssertionError):
    """Findings at or above the failing severity; ``str()`` is the findings table.

    A verdict, not a bad input: it is no ``DtypeAuditError``. An ``AssertionError``, so pytest shows it as a failed
    check and training loops stop on it."""

    def __init__(self, findings: Iterable[Finding], *, title: str, fail_on: Severity = "error") -> None:
        self.findings = list(findings)
        self.table = render_findings(self.findings, title=title, fail_on=fail_on)
        super().__init__(f"dtype audit failed: {title}")

    def __str__(self) -> str:
        return self.table


def render_findings(findings: Iterable[Finding], *, title: str, fail_on: Severity = "error", width: int = 120) -> str:
    """The findings as the text report's findings table (plain, no colour), with a one-line verdict."""
    from rich.text import Text

    from .inventory import CheckpointReport
    from .render.text import console_for, findings_section

    items = tuple(findings)
    buffer = io.StringIO()
    console = console_for(buffer, color=False, width=width)
    console.print(Text(title, style="bold"))
    if items:
        findings_section(console, CheckpointReport(title, LIVE_FORMAT, None, None, items), verbose=False)
    failing = [f for f in items if severity_rank(f.severity) >= severity_rank(fail_on)]
    counts = Counter(f.severity for f in items)
    summary = (
        ", ".join(f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in ("error", "warning", "info") if counts[s]) or "no findings"
    )
    verdict = f"✗ {summary} (failing at {fail_on})" if failing else f"✓ {summary}, none at or above {fail_on}"
    console.print(verdict)
    return "\n".join(line.rstrip() for line in buffer.getvalue().split("\n"))


# -- training loops: the part the Lightning and transformers callbacks share ---------------------------------------


def parse_when(when: str) -> int | None:
    """``fit`` -> None (fit start only), ``epoch`` -> 0 (every epoch), ``step:N`` -> N (every N optimizer steps)."""
    if when in ("fit", "epoch"):
        return None if when == "fit" else 0
    head, _, count = when.partition(":")
    if head == "step" and count.isdigit() and int(count) > 0:
        return int(count)
    raise DtypeAuditError(f"when={when!r}: use 'fit' (fit start only), 'epoch' or 'step:N' (N > 0)")


class TrainingAudit:
    """Audits a model (and its optimizers) at fit start, then every epoch or every N steps, and its first batch.

    Failing findings (at or above ``fail_on``, as for scan) raise ``AuditFailed``, which stops the run, or with
    ``on_failure="warn"`` are logged as a warning on the ``dtypeaudit`` logger; findings below ``fail_on`` are
    logged at INFO. Every audit's findings stay in ``history``.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        target: Target | str | None = None,
        when: str = "fit",
        fail_on: Severity | None = None,
        on_failure: str = "raise",
        drift_severity: Severity = "warning",
        check_batch: bool = True,
    ) -> None:
        import logging

        if on_failure not in ("raise", "warn"):
            raise DtypeAuditError(f"on_failure={on_failure!r}: use 'raise' or 'warn'")
        self.every = parse_when(when)
        self.when = when
        self.on_failure = on_failure
        self.check_batch = check_batch
        self.auditor = Auditor(policy, target=target, fail_on=fail_on, drift_severity=drift_severity)
        self.batch_seen = False
        self.last_step: int | None = None
        self._log = logging.getLogger("dtypeaudit")  # not self.log: Lightning sets a log() on callbacks

    @property
    def history(self) -> list[tuple[str, list[Finding]]]:
        return self.auditor.history

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every audit so far."""
        return [f for _, found in self.auditor.history for f in found]

    def run(self, label: str, parts: list[tuple[str, Any]]) -> list[Finding]:
        """Audit ``parts`` (``(prefix, object)``; the model under ``""``), report, and fail if asked to."""
        found = self.auditor.audit(parts=parts, label=label)
        self.enforce(found, label)
        return found

    def wants_epoch(self) -> bool:
        return self.every == 0

    def wants_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` is one to audit at (once per step, whatever the accumulation)."""
        if not self.every or step <= 0 or step % self.every or step == self.last_step:
            return False
        self.last_step = step
        return True

    def first_batch(self, model: Any, batch: Any) -> list[Finding]:
        """The first batch against the model's first layer, the policy and the target; once per run."""
        if self.batch_seen or not self.check_batch:
            return []
        self.batch_seen = True
        live = collect(None, parts=[("", model), ("batch", batch)])
        a = self.auditor
        found = batch_findings(live)
        batch = live.part(batch=True)
        if a.policy is not None and batch.tensors:
            found += policy_findings(batch, a.policy)
        if a.target is not None:
            from .targets import target_findings

            found += target_findings(batch, a.target)
        a.history.append(("the first batch", found))
        self.enforce(found, "the first batch")
        return found

    def enforce(self, found: list[Finding], label: str) -> None:
        if not found:
            return
        a = self.auditor
        failing = a.failing(found)
        title = f"dtypeaudit: {label}"
        if failing and self.on_failure == "raise":
            raise AuditFailed(found, title=title, fail_on=a.fail_on)
        table = render_findings(found, title=title, fail_on=a.fail_on)
        self._log.log(30 if failing else 20, "%s", table)
