"""What a converted model folder does with the files beside its weights that are not the model: a Trainer's
training state is carried unchanged (copied byte for byte: optimizer state is never cast), what ``--exclude`` left
out is not written. The plan says which, one line per group, before anything is written (``folder_notes``).

An unsafe file (``training_args.bin`` pickles TrainingArguments, whose globals no allowlist takes) is not here: the
reader's findings refuse the whole conversion (``safety.reader_refusals``, exit 2), as scan fails the folder, and the
refusal names ``--exclude``. Nothing from a checkpoint is executed, and nothing we write carries a payload forward:
a file is copied only when the safety scan read it and passed it (or when it is no format any loader deserialises).
"""

from __future__ import annotations

from pathlib import Path

from ..formats.training import in_trainer_order, trainer_file
from ..inventory import Inventory


def folder_notes(source: Inventory, src_dir: Path, weights: set[str]) -> list[str]:
    """The plan's lines about the files of ``src_dir`` beside its ``weights``: the Trainer's training state carried
    unchanged, and the files ``--exclude`` left out (``source``'s reader recorded them)."""
    excluded = source.metadata.get("excluded")
    left = dict(excluded) if isinstance(excluded, dict) else {}
    names = sorted(p.name for p in src_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    carried = [n for n in names if trainer_file(n) is not None and n not in left and n not in weights]
    notes = []
    if carried:
        notes.append(f"carried unchanged: {', '.join(in_trainer_order(carried))} (training state, copied byte for byte: not cast)")
    if left:
        shown = ", ".join(f"{label} (--exclude {pattern})" for label, pattern in sorted(left.items()))
        notes.append(f"left out: {shown}; not read, so not written")
    return notes
