"""dtypeaudit: audit and convert the dtypes of PyTorch checkpoints without running their code.

Library API::

    import dtypeaudit
    inventory = dtypeaudit.read("model.safetensors")                     # Inventory: every tensor, no torch
    policy = dtypeaudit.load_policy("fp16-weights-fp32-norms")           # a preset name or a YAML file
    findings = dtypeaudit.check(inventory, policy)                       # list[Finding]
    report = dtypeaudit.scan(["ckpts/"], checks=dtypeaudit.checks_for(policy), policy=policy, strict=policy.strict)
    result = dtypeaudit.convert("model.pt", "fp16", policy=policy)      # plan, check, write, verify
    result.refused                                                       # findings that forbid converting; nothing written
    settings = dtypeaudit.convert_settings("bf16", preset="bf16-mixed", clamp=True)  # checked before any read
    result = dtypeaudit.convert("model.pt", settings=settings)           # as `dtypeaudit convert` runs
    report = dtypeaudit.scan(["ckpts/"], settings=dtypeaudit.scan_settings(preset="fp16-mixed", target="t4"))
    findings = dtypeaudit.audit(model, "fp16-mixed", target="t4")        # a live nn.Module, optimizer, scaler, batch or dict

``policy=`` adds the run's ``unused-rule`` warnings (rules that no checkpoint used). ``strict=True`` raises
every finding a loader might read differently from dtypeaudit (loader-divergence, foreign-global,
trailing-data, unused-weights) to an error: for security-sensitive gates.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

# Everything is loaded on first use: `import dtypeaudit` (and `dtypeaudit --version`) pays for nothing, and a plain
# scan does not pay for YAML, the policy language or conversion.
_LAZY = {
    "check": ("checks", "check"),
    "checks_for": ("checks", "checks_for"),
    "strict_findings": ("checks", "strict_findings"),
    "CheckpointError": ("errors", "CheckpointError"),
    "ConversionError": ("errors", "ConversionError"),
    "DtypeAuditError": ("errors", "DtypeAuditError"),
    "PolicyError": ("errors", "PolicyError"),
    "read": ("formats", "read_checkpoint"),
    "CheckpointReport": ("inventory", "CheckpointReport"),
    "Finding": ("inventory", "Finding"),
    "Inventory": ("inventory", "Inventory"),
    "Report": ("inventory", "Report"),
    "TensorRecord": ("inventory", "TensorRecord"),
    "scan": ("pipeline", "scan"),
    "load_policy": ("policy", "load_policy"),
    "Policy": ("policy", "Policy"),
    "convert": ("conversion", "convert"),
    "ScanSettings": ("options", "ScanSettings"),
    "ConvertSettings": ("options", "ConvertSettings"),
    "scan_settings": ("options", "effective"),
    "convert_settings": ("options", "convert_settings"),
    "audit": ("live", "audit"),
    "Auditor": ("live", "Auditor"),
    "tune": ("tuning", "tune"),
    "apply": ("tuning", "apply"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        module, attr = _LAZY[name]
        value = getattr(import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value  # later look-ups skip this hook (and see the function, not a submodule of that name)
        return value
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
    "ScanSettings",
    "ConvertSettings",
    "scan_settings",
    "convert_settings",
    "audit",
    "Auditor",
    "tune",
    "apply",
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
