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

from ..inventory import TensorRecord

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
    "trainer_state.json": "the Trainer's progress (step, log history)",
    "training_args.bin": "the TrainingArguments object",
}
_RNG_STATE = re.compile(r"^rng_state(_\d+)?\.pth$")


def trainer_file(label: str) -> str | None:
    """What a file at the top of a model folder holds when it is one ``Trainer`` writes into ``checkpoint-N/``
    beside the weights (``label``: its path in the folder), or None for any other file."""
    if "/" in label:
        return None
    if _RNG_STATE.match(label):
        return "RNG state (python, numpy and torch generators), no weights"
    return _TRAINER_FILES.get(label)


def holds_optimizer_state(label: str) -> bool:
    """Whether the Trainer file ``label`` is the optimizer's ``state_dict()`` (its tensors: Adam's moments, steps)."""
    return label in ("optimizer.pt", "optimizer.bin")


def is_trainer_checkpoint(names: set[str]) -> bool:
    """Whether a folder whose top-level file names are ``names`` is a Trainer's ``checkpoint-N/``: the Trainer
    writes trainer_state.json at every save (and training_args.bin beside it)."""
    return "trainer_state.json" in names or "training_args.bin" in names
