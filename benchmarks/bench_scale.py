"""Bad input that costs too much (issue 31): a safetensors header with a million tensors, and a shard index
with a million entries.

Made under benchmarks/_work/scale by writing the safetensors layout directly (8-byte length, JSON header,
data), which is what the safetensors crate writes, without a million torch tensors:

- ``million.safetensors``: 1,000,000 tensors in 1,000 Llama-shaped layers of 1,000 modules each: q/k/v/o
  projections (float16 weights, a few with a float32 bias, which the module check flags), RMSNorm-like norms in
  float32, and bfloat16 embeddings, each tensor of shape [1] or [1, 1] so that the header, not the data, is
  the cost;
- ``index/``: a Hugging Face folder whose ``model.safetensors.index.json`` maps 1,000,000 names to one small
  shard that holds only some of them (the folder reader reports the rest).

Measured: wall time and peak RSS of whole ``dtypeaudit scan`` processes, ``-q``, the table (``-f plain``,
as a terminal gets it but without colour) and ``--format json``. Target (issue 31): at most 15 s and 1 GB
each. Writes the figures, with the machine's load, into benchmarks/SCALE.md.

    python benchmarks/bench_scale.py               # a million tensors
    python benchmarks/bench_scale.py --tensors 100000 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

from common import WORK, measure_all, python

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def _module_tensors(i: int) -> list[tuple[str, str, list[int]]]:
    """The tensors of module ``i``: (name, dtype code, shape), named as a Llama layer's parts are (short names, so
    that a million of them stay under the crate's 100 MB header cap)."""
    layer, slot = divmod(i, 1000)
    p = f"layers.{layer}.{slot}"
    kind = slot % 8
    if kind < 4:
        name = f"{p}.{('q_proj', 'k_proj', 'v_proj', 'o_proj')[kind]}"
        # one module in 50 carries a float32 bias: a Linear that mixes dtypes (an error per module)
        return [(f"{name}.weight", "F16", [1, 1]), (f"{name}.bias", "F32" if slot % 50 == 0 else "F16", [1])]
    if kind < 6:
        return [(f"{p}.input_layernorm.weight", "F32", [1])]
    if kind == 6:
        return [(f"{p}.embed_tokens.weight", "BF16", [1, 1])]
    return [(f"{p}.down_proj.weight", "F16", [1, 1])]


def tensor_names(count: int) -> list[tuple[str, str, list[int]]]:
    out: list[tuple[str, str, list[int]]] = []
    i = 0
    while len(out) < count:
        out.extend(_module_tensors(i))
        i += 1
    return out[:count]


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int]]]) -> None:
    """The crate's layout: little-endian u64 header length, the JSON header, then the tensors' bytes in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, code, shape in tensors:
        size = _ITEMSIZE[code] * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the crate pads the header to 8 bytes with spaces
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"\0" * offset)
    tmp.rename(path)


def make_inputs(root: Path, count: int) -> tuple[Path, Path]:
    """The million-tensor file and the million-entry index folder (made once per count)."""
    root = root / str(count)
    root.mkdir(parents=True, exist_ok=True)
    big = root / "million.safetensors"
    tensors = tensor_names(count)
    if not big.exists():
        write_safetensors(big, tensors)
    folder = root / "index"
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
        # a short shard name: a million entries then stay under the 64 MiB cap on JSON files
        write_safetensors(folder / "w.safetensors", tensors[:1000])
        weight_map = {name: "w.safetensors" for name, _, _ in tensors}
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, separators=(",", ":")))
        tmp.rename(index)
    return big, folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print the figures, leave SCALE.md as it is")
    args = ap.parse_args()
    big, folder = make_inputs(WORK / "scale", args.tensors)
    out = WORK / "scale" / "report.json"
    scan = [python(), "-m", "dtypeaudit", "scan"]
    commands: dict[str, tuple[list[str], Path | None]] = {}
    for label, target in (("1M-tensor header", big), ("1M-entry index", folder)):
        commands[f"{label}, -q"] = ([*scan, str(target), "-q", "-f", "plain"], None)
        commands[f"{label}, table"] = ([*scan, str(target), "-f", "plain"], None)
        commands[f"{label}, --format json"] = ([*scan, str(target), "--format", "json", "-o", str(out)], out)
    load_before = os.getloadavg()
    results = measure_all(commands, repeat=args.repeat)
    load_after = os.getloadavg()
    rows = [f"| {label} | {m.wall_s:.1f} | {m.peak_rss_mb:.0f} |" for label, m in results.items()]
    load = f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores"
    table = "\n".join(["| command | wall (s) | peak RSS (MB) |", "|---|---:|---:|", *rows])
    print(f"{args.tensors} tensors; {load}\n{table}")
    if args.no_write:
        return
    text = f"""# Scale: a million tensors in one header (issue 31)

Whole `dtypeaudit scan` processes on a header of {args.tensors:,} tensors ({big.stat().st_size / 1e6:.0f} MB file)
and a shard index of {args.tensors:,} entries, measured by `python benchmarks/bench_scale.py` (median of
{args.repeat} run(s) each; peak RSS of the process and its children). Target: at most 15 s and 1 GB each.

Measured {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, Python {sys.version.split()[0]}, {load}
(a shared machine: the figures are noisy).

{table}
"""
    out_md = Path(__file__).parent / "SCALE.md"
    kept = out_md.read_text().partition("\n## Notes")[1:] if out_md.exists() else ()
    out_md.write_text(text + "".join(kept))  # the hand-written notes below the figures stay


if __name__ == "__main__":
    main()
