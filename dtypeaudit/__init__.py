"""dtypeaudit: audit and convert the dtypes of PyTorch checkpoints without running their code.

Library API::

    import dtypeaudit
    inventory = dtypeaudit.read("model.safetensors")                     # Inventory: every tensor, no torch
    policy = dtypeaudit.load_policy("fp16-weights-fp32-norms")           # a preset name or a YAML file
    findings = dtypeaudit.check(inventory, policy)                       # list[Finding]
    report = dtypeaudit.scan(["ckpts/"], checks=dtypeaudit.checks_for(policy), policy=policy, strict=policy.strict)
    result = dtypeaudit.convert("model.pt", "fp16", policy=policy)      # plan, check, write, verify
    result.refused                                                       # findings that forbid converting; nothing written
    findings = dtypeaudit.audit(model, "fp16-mixed", target="t4")        # a live nn.Module, optimizer, scaler, batch or dict

``policy=`` adds the run's ``unused-rule`` warnings (rules that no checkpoint used). ``strict=True`` raises
every finding a loader might read differently from dtypeaudit (loader-divergence, foreign-global,
trailing-data, unused-weights) to an error: for security-sensitive gates.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from .check import check, checks_for, strict_findings  # noqa: E402
from .errors import CheckpointError, ConversionError, DtypeAuditError, PolicyError  # noqa: E402
from .formats import read_checkpoint as read  # noqa: E402
from .inventory import CheckpointReport, Finding, Inventory, Report, TensorRecord  # noqa: E402
from .scan import scan  # noqa: E402

# Loaded on first use, so that a plain scan does not pay for YAML, the policy language or conversion.
_LAZY = {
    "load_policy": ("policy", "load_policy"),
    "Policy": ("policy", "Policy"),
    "convert": ("conversion", "convert"),
    "audit": ("live", "audit"),
    "Auditor": ("live", "Auditor"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        module, attr = _LAZY[name]
        return getattr(import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "scan",
    "read",
    "load_policy",
    "Policy",
    "check",
    "checks_for",
    "strict_findings",
    "convert",
    "audit",
    "Auditor",
    "CheckpointError",
    "ConversionError",
    "DtypeAuditError",
    "PolicyError",
    "CheckpointReport",
    "Finding",
    "Inventory",
    "Report",
    "TensorRecord",
]
