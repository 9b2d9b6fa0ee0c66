"""The directory mode of the differential fuzzer: random Hugging Face and DCP folders, compared with the loaders.

Each case is a folder written by the real writers from a seeded generator: a tiny GPT-2 saved by
save_pretrained (single file, sharded with an index, or pytorch_model.bin), its tensors' stored dtypes mixed
at random, config.json's dtype spelt every way transformers reads it (``dtype``, ``torch_dtype``, both, null,
a dict, an alias, a name torch lacks, a key given twice), the index's ``metadata.dtype``, and files beside the
weights (a clean or a payload-carrying ``training_args.bin``, an optimizer, a README); or a DCP folder saved by
``dcp.save`` with tensors and non-tensor items. The reference is ``from_pretrained(folder)`` with its default
arguments (the loaded model's dtypes, or its refusal) or ``dcp_to_torch_save``; a planted payload must give an
``unsafe-global`` error and never run.

Verdicts: AGREE (same dtypes, or both refuse), DIFFERENTIAL (both read, dtypes differ), MISSED (a payload not
reported), REFUSED-ONLY-BY-US / REFUSED-ONLY-BY-LOADER.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

DTYPES = ["float16", "bfloat16", "float32"]
SPELLINGS = ["absent", "dtype", "torch_dtype", "both", "null-dtype", "dict-empty", "dict-main", "alias", "invalid", "duplicate"]
LAYOUTS = ["single", "sharded", "sharded-index-dtype", "bin"]


class Payload:
    """Pickles as a call to os.system; never loaded by anything here."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.canary}",))


def _config_text(base: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """config.json's text with a random dtype spelling, and the spelling's name."""
    cfg = {k: v for k, v in base.items() if k not in ("dtype", "torch_dtype")}
    spelling = rng.choice(SPELLINGS)
    a, b = rng.choice(DTYPES), rng.choice(DTYPES)
    if spelling == "dtype":
        cfg["dtype"] = a
    elif spelling == "torch_dtype":
        cfg["torch_dtype"] = a
    elif spelling == "both":
        cfg["dtype"], cfg["torch_dtype"] = a, b
    elif spelling == "null-dtype":
        cfg["dtype"], cfg["torch_dtype"] = None, a
    elif spelling == "dict-empty":
        cfg["dtype"] = {}
    elif spelling == "dict-main":
        cfg["dtype"] = {"": a}
    elif spelling == "alias":
        cfg["dtype"] = rng.choice(["half", "float", "double"])
    elif spelling == "invalid":
        cfg["dtype"] = rng.choice(["auto", "fp16", "torch.float16", "Float16"])
    text = json.dumps(cfg)
    if spelling == "duplicate":
        text = text[:-1] + f', "dtype": "{a}", "dtype": "{b}"}}'
    return text, spelling


def make_hf(folder: Path, seed: int, payload: bool | None = None) -> dict[str, Any]:
    """A random from_pretrained folder; returns what was planted."""
    import torch
    import transformers

    rng = random.Random(seed)
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    mixed = rng.random() < 0.5
    main = rng.choice(DTYPES)
    for p in model.parameters():
        p.data = p.data.to(getattr(torch, rng.choice(DTYPES) if mixed else main))
    layout = rng.choice(LAYOUTS)
    kwargs: dict[str, Any] = {"max_shard_size": "2KB"} if layout.startswith("sharded") else {}
    if layout == "bin":
        kwargs["safe_serialization"] = False
    model.save_pretrained(str(folder), **kwargs)
    base = json.loads((folder / "config.json").read_text())
    text, spelling = _config_text(base, rng)
    (folder / "config.json").write_text(text)
    if layout == "sharded-index-dtype":
        index_path = next(folder.glob("*.index.json"))
        index = json.loads(index_path.read_text())
        index.setdefault("metadata", {})["dtype"] = rng.choice(DTYPES)
        index_path.write_text(json.dumps(index))
    planted = rng.random() < 0.3
    payload = planted if payload is None else payload
    canary = folder.parent / f"canary-{seed}"
    extras = rng.sample(["training_args.bin", "optimizer.pt", "README.md"], k=rng.randint(0, 3))
    if payload and "training_args.bin" not in extras:
        extras.append("training_args.bin")
    for name in extras:
        if name == "README.md":
            (folder / name).write_text("# a model\n")
        elif name == "training_args.bin":
            torch.save({"lr": 0.1, "args": Payload(canary)} if payload else {"lr": 0.1}, folder / name)
        else:
            torch.save({"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}, folder / name)
    payload = payload and "training_args.bin" in extras
    return {"kind": "hf", "layout": layout, "spelling": spelling, "mixed": mixed, "payload": payload, "canary": str(canary)}


def make_dcp(folder: Path, seed: int, payload: bool | None = None) -> dict[str, Any]:
    """A random torch.distributed.checkpoint folder: tensors, nested dicts, and items DCP saves as bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    rng = random.Random(seed)
    state: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        state[f"t{i}"] = torch.zeros(rng.randint(1, 4), dtype=getattr(torch, rng.choice(DTYPES)))
    if rng.random() < 0.5:
        state["nested"] = {"w": torch.zeros(2, dtype=getattr(torch, rng.choice(DTYPES))), "step": rng.randint(0, 9)}
    if rng.random() < 0.5:
        state["pair"] = (torch.zeros(1, dtype=getattr(torch, rng.choice(DTYPES))), "x")
    planted = rng.random() < 0.3
    payload = planted if payload is None else payload
    canary = folder.parent / f"canary-{seed}"
    if payload:
        state["cmd"] = Payload(canary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return {"kind": "dcp", "payload": payload, "canary": str(canary)}


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix: str(value.dtype)[6:]}
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {}
    out: dict[str, str] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def reference(folder: Path, planted: dict[str, Any]) -> dict[str, str] | str:
    """The loader's dtypes by name, or ``"refused: <why>"``."""
    import torch

    if planted["kind"] == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        if planted["payload"]:
            return "skipped"  # dcp_to_torch_save would run the payload: the verdict is the safety check alone
        flat = folder.parent / f"{folder.name}.flat.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(folder), str(flat))
        return _flatten(torch.load(flat, weights_only=False))  # written just now from a payload-free state
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(str(folder))
    except Exception as exc:  # any refusal of the loader
        return f"refused: {type(exc).__name__}"
    return {k: str(v.dtype)[6:] for k, v in model.state_dict().items()}


def ours(folder: Path) -> tuple[dict[str, str] | str, list[str]]:
    """dtypeaudit's loaded dtypes by name (or ``"refused: ..."``), and its unsafe-global messages."""
    from dtypeaudit.checks import check, loaded_dtype
    from dtypeaudit.errors import DtypeAuditError
    from dtypeaudit.formats import read_checkpoint

    try:
        inv = read_checkpoint(folder)
    except DtypeAuditError as exc:
        return f"refused: {exc.one_line()}", []
    loaded = loaded_dtype(inv)
    unsafe = [f.message for f in check(inv) if f.rule == "unsafe-global"]
    return {t.name: loaded.get(t.name, t.dtype) for t in inv.tensors if t.layout != "storage"}, unsafe


def run_case(seed: int, kind: str | None = None, keep: Path | None = None, payload: bool | None = None) -> dict[str, Any]:
    """One case: write the folder, ask both, give the verdict (``payload`` plants one or none, else at random)."""
    rng = random.Random(seed)
    kind = kind or ("dcp" if rng.random() < 0.3 else "hf")
    tmp = Path(tempfile.mkdtemp(prefix="dtypeaudit-dirfuzz-"))
    try:
        folder = tmp / "case"
        planted = make_dcp(folder, seed, payload) if kind == "dcp" else make_hf(folder, seed, payload)
        ref = reference(folder, planted)
        got, unsafe = ours(folder)
        verdict = _verdict(ref, got, unsafe, planted)
        if Path(planted["canary"]).exists():
            verdict = "RAN-CODE"
        if keep is not None and verdict != "AGREE":
            shutil.copytree(folder, keep / f"{kind}-{seed}", dirs_exist_ok=True)
        return {"seed": seed, "kind": kind, "planted": planted, "verdict": verdict, "reference": ref, "ours": got}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _verdict(ref: dict[str, str] | str, got: dict[str, str] | str, unsafe: list[str], planted: dict[str, Any]) -> str:
    if planted["payload"] and not isinstance(got, str) and not any("posix.system" in m or "os.system" in m for m in unsafe):
        return "MISSED"  # read and passed over (a refusal, exit 2, fails a gate too)
    if ref == "skipped":
        return "AGREE"
    if isinstance(ref, str) and isinstance(got, str):
        return "AGREE"
    if isinstance(ref, str):
        return "REFUSED-ONLY-BY-LOADER"
    if isinstance(got, str):
        return "REFUSED-ONLY-BY-US"
    shared = set(ref) & set(got)
    if len(shared) < len(got) - 1 or any(ref[n] != got[n] for n in shared):
        return "DIFFERENTIAL"
    return "AGREE"
