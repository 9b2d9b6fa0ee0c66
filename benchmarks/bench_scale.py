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
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from common import WORK, python, run_once

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


def make_inputs(root: Path, count: int) -> tuple[Path, Path, Path]:
    """The million-tensor file, the million-entry index folder and the no-findings file (made once per count)."""
    root = root / str(count)
    root.mkdir(parents=True, exist_ok=True)
    big = root / "million.safetensors"
    if not big.exists():
        write_safetensors(big, tensor_names(count))
    plain = root / "plain.safetensors"
    if not plain.exists():
        # issue 31's own file: a million F32 [1] tensors, no finding (the reference that the load touches alike)
        write_safetensors(plain, [(f"t{i}", "F32", [1]) for i in range(count)])
    folder = root / "index"
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
        # a short shard name: a million entries then stay under the 64 MiB cap on JSON files
        tensors = tensor_names(count)
        write_safetensors(folder / "w.safetensors", tensors[:1000])
        weight_map = {name: "w.safetensors" for name, _, _ in tensors}
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, separators=(",", ":")))
        tmp.rename(index)
    return big, folder, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print the figures, leave SCALE.md as it is")
    ap.add_argument("--baseline", type=Path, help="a folder holding an earlier dtypeaudit package, run alike in the same run (its column)")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_only:
        make_inputs(WORK / "scale", args.tensors)
        return
    # Made in a child: each measured command is forked from this process, and a child's peak RSS counts what
    # its parent held when it forked (the lists that write a million-tensor header are hundreds of MB).
    subprocess.run([python(), __file__, "--tensors", str(args.tensors), "--make-only"], check=True)
    big, folder, plain = (WORK / "scale" / str(args.tensors) / name for name in ("million.safetensors", "index", "plain.safetensors"))
    out = WORK / "scale" / "report.json"
    commands: dict[str, tuple[list[str], Path | None]] = {}
    for label, target in (("1M-tensor header", big), ("1M-entry index", folder)):
        commands[f"{label}, -q"] = ([str(target), "-q", "-f", "plain"], None)
        commands[f"{label}, table"] = ([str(target), "-f", "plain"], None)
        commands[f"{label}, --format json"] = ([str(target), "--format", "json", "-o", str(out)], out)
    # issue 31's own file: a million F32 [1] tensors, no findings, in every format as well
    commands["1M F32 [1] header, no findings, -q"] = ([str(plain), "-q", "-f", "plain"], None)
    commands["1M F32 [1] header, no findings, table"] = ([str(plain), "-f", "plain"], None)
    commands["1M F32 [1] header, no findings, --format json"] = ([str(plain), "--format", "json", "-o", str(out)], out)
    here = Path(__file__).resolve().parent.parent  # this checkout's package, whatever the working directory
    trees = {"this": here, "baseline": args.baseline.resolve()} if args.baseline else {"this": here}
    load_before = os.getloadavg()
    # interleaved (A B C ..., A B C ...) and the baseline beside each, so that a drifting machine touches each alike
    runs: dict[tuple[str, str], list] = {}
    for _ in range(args.repeat):
        for label, (cmd_args, output) in commands.items():
            for tree, where in trees.items():
                # -P: the working directory's package, if any, is not put before PYTHONPATH's
                cmd = ["env", f"PYTHONPATH={where}", python(), "-P", "-m", "dtypeaudit", "scan", *cmd_args]
                runs.setdefault((label, tree), []).append(run_once(cmd, output, [out]))
    load_after = os.getloadavg()
    head = ["command", "wall (s)", "CPU (s)", "peak RSS (MB)"]
    if args.baseline:
        head += ["baseline wall (s)", "baseline CPU (s)", "baseline peak RSS (MB)"]
    rows = []
    for label in commands:
        cells = [label]
        for tree in trees:
            rs = runs[(label, tree)]
            cells += [
                f"{statistics.median(r.wall_s for r in rs):.1f}",
                f"{statistics.median(r.cpu_s for r in rs):.1f}",
                f"{max(r.peak_rss_mb for r in rs):.0f}",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    load = f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores"
    table = "\n".join(["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|", *rows])
    print(f"{args.tensors} tensors; {load}\n{table}")
    if args.no_write:
        return
    text = f"""# Scale: a million tensors in one header (issue 31)

Whole `dtypeaudit scan` processes on a header of {args.tensors:,} tensors ({big.stat().st_size / 1e6:.0f} MB file)
and a shard index of {args.tensors:,} entries, measured by `python benchmarks/bench_scale.py` (median of
{args.repeat} run(s) each; CPU: user + system time; peak RSS of the process and its children). Target: at most 15 s
and 1 GB each.

Measured {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, Python {sys.version.split()[0]}, {load}
(a shared machine: the figures are noisy).

{table}
"""
    out_md = Path(__file__).parent / "SCALE.md"
    kept = out_md.read_text().partition("\n## Notes")[1:] if out_md.exists() else ()
    out_md.write_text(text + "".join(kept))  # the hand-written notes below the figures stay


if __name__ == "__main__":
    main()
