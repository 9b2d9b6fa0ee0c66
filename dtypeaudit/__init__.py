"""dtypeaudit: audit and convert the dtypes of PyTorch checkpoints without running their code.

Library API::

    import dtypeaudit
    report = dtypeaudit.scan(["model.pt"])                   # Report
    inventory = dtypeaudit.read("model.safetensors")         # Inventory
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import CheckpointError, DtypeAuditError, PolicyError  # noqa: E402
from .formats import read_checkpoint as read  # noqa: E402
from .inventory import CheckpointReport, Finding, Inventory, Report, TensorRecord  # noqa: E402
from .scan import scan  # noqa: E402

__all__ = [
    "__version__",
    "scan",
    "read",
    "CheckpointError",
    "DtypeAuditError",
    "PolicyError",
    "CheckpointReport",
    "Finding",
    "Inventory",
    "Report",
    "TensorRecord",
]
