"""Lightning: ``DtypeAuditCallback`` audits a LightningModule, its optimizers and its first batch during ``fit``.

::

    from dtypeaudit.lightning import DtypeAuditCallback
    trainer = Trainer(callbacks=[DtypeAuditCallback(policy="amp-training", when="epoch")])

It audits at fit start, then at the end of every epoch (``when="epoch"``) or every N optimizer steps
(``when="step:N"``), reporting ``dtype-drift`` against the audit before; the first training batch is compared
with the model's first layer (``batch-dtype``). Failing findings (``fail_on``, as for scan) raise
``dtypeaudit.live.AuditFailed``, which stops the run; ``on_failure="warn"`` logs them instead.

The model's tensors are named as ``state_dict()`` names them, the optimizer's under ``optimizer.`` (``optimizers.I.``
when there are several), a mixed-precision GradScaler's under ``scaler.``, the batch's under ``batch.``.

Works with the ``lightning`` package and the older ``pytorch_lightning``: the class derives from whichever
``Callback`` is installed (``lightning`` first), and both Trainers call a callback's hooks by name, so the one
class serves either. Neither package is imported until the class is first asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .live import TrainingAudit


def _parts(trainer: Any, pl_module: Any) -> list[tuple[str, Any]]:
    parts: list[tuple[str, Any]] = [("", pl_module)]
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    if len(optimizers) == 1:
        parts.append(("optimizer", optimizers[0]))
    else:
        parts += [(f"optimizers.{i}", o) for i, o in enumerate(optimizers)]
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is not None:
        parts.append(("scaler", scaler))
    return parts


class _LightningHooks(TrainingAudit):
    """Audit a LightningModule's dtypes at fit start, every epoch or every N steps, and its first batch.

    Arguments: ``policy`` (a Policy, preset name or YAML file), ``target`` (a hardware target), ``when``
    (``fit``, ``epoch`` or ``step:N``), ``fail_on`` (default: the policy's, else ``error``), ``on_failure``
    (``raise`` or ``warn``), ``drift_severity`` (``warning``), ``check_batch`` (True).
    """

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.run("fit start", _parts(trainer, pl_module))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.first_batch(pl_module, batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.wants_step(int(trainer.global_step)):
            self.run(f"step {trainer.global_step}", _parts(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.wants_epoch():
            self.run(f"the end of epoch {trainer.current_epoch}", _parts(trainer, pl_module))


def callback_base() -> type:
    """Lightning's ``Callback`` class: from ``lightning`` if installed, else from ``pytorch_lightning``."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return import_module(package).Callback
        except ImportError:
            continue
    raise ImportError("dtypeaudit.lightning needs the lightning (or pytorch_lightning) package: pip install lightning")


def __getattr__(name: str) -> Any:
    if name == "DtypeAuditCallback":
        namespace = {"__module__": __name__, "__doc__": _LightningHooks.__doc__, "__qualname__": name}
        cls = type(name, (_LightningHooks, callback_base()), namespace)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
