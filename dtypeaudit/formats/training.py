"""Training state kept beside the weights: what it is, in one home for the readers, the checks and convert.

Two places hold it. Inside one torch.save file, under top-level keys the training code owns (Lightning's
``callbacks`` and ``loops``, the schedulers', a GradScaler's): ``is_training_state``. Beside a model folder's weights,
in the files ``transformers.Trainer._save_checkpoint`` writes into ``checkpoint-N/`` (transformers 5.24's
``OPTIMIZER_NAME``, ``SCHEDULER_NAME``, ``SCALER_NAME``, ``TRAINER_STATE_NAME``, ``TRAINING_ARGS_NAME`` and
``_save_rng_state``'s ``rng_state.pth`` / ``rng_state_{process_index}.pth``): ``trainer_file``. None of it is a
weight: convert never casts it, and a policy's default (which speaks for weights) does not judge it.
"""

from __future__ import annotations

import re

from ..inventory import Finding, Inventory, TensorRecord

# Top-level keys under which training code keeps its own state beside the weights: Lightning's ``callbacks``
# (ModelCheckpoint's ``kth_value`` and ``best_model_score`` start as inf), ``loops`` and ``lr_schedulers``; a
# GradScaler's ``scaler`` (its scale, 65536 by default, is beyond float16's range by design). The model never
# reads these: their values are not the weights' business, so no value check may refuse a conversion on them.
TRAINING_STATE_KEYS = frozenset({"callbacks", "loops", "lr_schedulers", "lr_scheduler", "scheduler", "scaler", "grad_scaler"})


def is_training_state(t: TensorRecord) -> bool:
    """Whether ``t`` is training state kept beside the weights in one file (see TRAINING_STATE_KEYS), not a weight,
    a buffer or optimizer state (whose region says so)."""
    return t.region == "model" and t.name.partition(".")[0] in TRAINING_STATE_KEYS


# What each file of a Trainer checkpoint holds, by the name the Trainer gives it (and resumes it from).
_TRAINER_FILES = {
    "optimizer.pt": "optimizer state",
    "optimizer.bin": "optimizer state",  # accelerate's name, which Trainer also resumes from
    "scheduler.pt": "LR scheduler state",
    "scaler.pt": "GradScaler state",
    "trainer_state.json": "the Trainer's step and log history",
    "training_args.bin": "the TrainingArguments object",
}
RNG_STATE_FILE = re.compile(r"^rng_state(_\d+)?\.pth$")
"""The name of the Trainer's RNG state file (``rng_state_{process_index}.pth`` under several processes)."""


def trainer_file(label: str) -> str | None:
    """What a file at the top of a model folder holds when it is one ``Trainer`` writes into ``checkpoint-N/``
    beside the weights (``label``: its path in the folder), or None for any other file."""
    if "/" in label:
        return None
    if RNG_STATE_FILE.match(label):
        return "the RNG state of python, numpy and torch, no weights"
    return _TRAINER_FILES.get(label)


def holds_optimizer_state(label: str) -> bool:
    """Whether the Trainer file ``label`` is the optimizer's ``state_dict()`` (its tensors: Adam's moments, steps)."""
    return label in ("optimizer.pt", "optimizer.bin")


def trainer_state(label: str, inv: Inventory | None) -> str | None:
    """What the Trainer file ``label`` holds, for a report, where its content (``inv``, as its reader read it; None
    for a file no loader deserialises, such as trainer_state.json) is what the name says: an optimizer file's
    tensors all optimizer state, an RNG file's all bytes (torch's generator states are uint8 tensors), the other
    files' none at all. None where it is not: such a file holds weights the model loader does not load."""
    kind = trainer_file(label)
    tensors = inv.tensors if inv is not None else ()
    if kind is None:
        return None
    if holds_optimizer_state(label):
        if not tensors or any(t.region != "optimizer" for t in tensors):
            return None
        dtypes = ", ".join(sorted({t.dtype for t in tensors}))
        return f"{kind}: {len(tensors)} tensor{'s' if len(tensors) != 1 else ''}, {dtypes}"
    if RNG_STATE_FILE.match(label):
        return kind if all(t.dtype == "uint8" for t in tensors) else None
    return None if tensors else kind


_ORDER = ("optimizer", "scheduler", "scaler", "rng_state", "trainer_state", "training_args")


def in_trainer_order(names: list[str]) -> list[str]:
    """Trainer files in the order the Trainer writes them: optimizer first."""
    return sorted(names, key=lambda n: (next((i for i, p in enumerate(_ORDER) if n.startswith(p)), len(_ORDER)), n))


def training_state_finding(described: dict[str, str]) -> Finding:
    """One ``training-state`` note for the Trainer files of a folder (``described``: label -> what it holds)."""
    shown = "; ".join(f"{label} ({described[label]})" for label in in_trainer_order(list(described)))
    return Finding(
        "training-state",
        "info",
        f"a Trainer checkpoint's training state, which Trainer.train(resume_from_checkpoint=...) reads and from_pretrained "
        f"does not: {shown}",
    )


def optimizer_parts(inv: Inventory) -> list[tuple[str, Inventory]]:
    """A Trainer folder's optimizer files, each with its inventory (its tensors: region ``optimizer``), as the folder's
    reader kept them (``Inventory.parts``, under the labels its ``training_state`` metadata names)."""
    described = inv.metadata.get("training_state")
    if not isinstance(described, dict):
        return []
    return [(label, inv.parts[label]) for label in described if holds_optimizer_state(label) and label in inv.parts]
