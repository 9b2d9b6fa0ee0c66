"""transformers: ``DtypeAuditCallback`` audits a model, its optimizer and its first batch during ``Trainer.train``.

::

    from dtypeaudit.transformers import DtypeAuditCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[DtypeAuditCallback(policy="fp32", when="epoch")])

It audits at train start, then at the end of every epoch (``when="epoch"``) or every N optimizer steps
(``when="step:N"``), reporting ``dtype-drift`` against the audit before. The first batch is seen by a forward
pre-hook on the model (the Trainer gives callbacks no batch), removed after that one call, and compared with
the model's first layer (``batch-dtype``). Failing findings (``fail_on``, as for scan) raise
``dtypeaudit.live.AuditFailed``, which stops training; ``on_failure="warn"`` logs them instead.

The model's tensors are named as ``state_dict()`` names them, the optimizer's under ``optimizer.``, the batch's
under ``batch.`` (the model's keyword arguments: ``batch.input_ids``). transformers is imported only when the
class is first asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .live import TrainingAudit


def _parts(model: Any, optimizer: Any) -> list[tuple[str, Any]]:
    parts: list[tuple[str, Any]] = [("", model)]
    if optimizer is not None:
        parts.append(("optimizer", optimizer))
    return parts


class _TrainerHooks(TrainingAudit):
    """Audit a transformers model's dtypes at train start, every epoch or every N steps, and its first batch.

    Arguments: ``policy`` (a Policy, preset name or YAML file), ``target`` (a hardware target), ``when``
    (``fit``, ``epoch`` or ``step:N``), ``fail_on`` (default: the policy's, else ``error``), ``on_failure``
    (``raise`` or ``warn``), ``drift_severity`` (``warning``), ``check_batch`` (True).
    """

    _hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.run("train start", _parts(model, optimizer))
        if self.check_batch and model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._see_batch, with_kwargs=True)

    def _see_batch(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._drop_hook()
        self.first_batch(module, {**{str(i): a for i, a in enumerate(args)}, **kwargs})

    def _drop_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if self.wants_step(int(state.global_step)):
            self.run(f"step {state.global_step}", _parts(model, optimizer))

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if self.wants_epoch():
            self.run(f"the end of epoch {max(round(state.epoch or 0) - 1, 0)}", _parts(model, optimizer))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._drop_hook()


def callback_base() -> type:
    """transformers' ``TrainerCallback``."""
    try:
        return import_module("transformers").TrainerCallback
    except ImportError:
        raise ImportError("dtypeaudit.transformers needs the transformers package: pip install transformers") from None


def __getattr__(name: str) -> Any:
    if name == "DtypeAuditCallback":
        cls = type(name, (_TrainerHooks, callback_base()), {"__module__": __name__, "__doc__": _TrainerHooks.__doc__, "__qualname__": name})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
