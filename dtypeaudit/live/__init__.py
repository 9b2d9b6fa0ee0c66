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

The package, by job: ``collection`` (the tensors of a live object), ``findings`` (the checks only a live object can
fail), ``auditor`` (``audit`` and ``Auditor``), ``verdict`` (``AuditFailed`` and its table), ``callbacks`` (what
the Lightning and transformers callbacks share).
"""

from __future__ import annotations

from .auditor import Auditor, Findings, as_policy, audit, findings_for
from .callbacks import TrainingAudit, parse_when
from .collection import LIVE_FORMAT, FirstLayer, LiveInventory, collect, describe, first_layer, inventory
from .findings import Snapshot, batch_findings, default_dtype_findings, drift_findings, snapshot
from .verdict import AuditFailed, render_findings

__all__ = [
    "LIVE_FORMAT",
    "AuditFailed",
    "Auditor",
    "Findings",
    "FirstLayer",
    "LiveInventory",
    "Snapshot",
    "TrainingAudit",
    "as_policy",
    "audit",
    "batch_findings",
    "collect",
    "default_dtype_findings",
    "describe",
    "drift_findings",
    "findings_for",
    "first_layer",
    "inventory",
    "parse_when",
    "render_findings",
    "snapshot",
]
