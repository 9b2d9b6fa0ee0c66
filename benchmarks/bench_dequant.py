"""dtypeaudit convert --to bf16 on an FP8 block-scaled checkpoint versus the script users write today, in one run.

The checkpoint: a Llama-shaped directory in DeepSeek-V3 / transformers ``fp8`` layout (float8_e4m3fn Linear
weights, a float32 ``weight_scale_inv`` per 128x128 block, bf16 embeddings and norms,
``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}``), ~2 GB, one shard, made once
under benchmarks/_work.

Baseline: what people adapt from DeepSeek's ``fp8_cast_bf16.py`` when they have no GPU for its Triton kernel:
``safetensors.torch.load_file`` the shard, dequantize each weight with a CPU loop over its 128x128 blocks,
``save_file`` the result, and write config.json without ``quantization_config``.
Targets (issue 17): wall time <= 0.5x the baseline, peak anonymous memory <= 0.25x of it. dtypeaudit fsyncs its
output before renaming it into place; the script leaves 4 GB dirty in the page cache. So a third row runs the
script followed by ``os.sync()``: the same bytes, durable, as the like-for-like time.
Both run as whole processes, interleaved, ``--repeat`` times each: medians of wall and CPU time (user + sys),
peaks of memory. ``--also REV`` adds a row for dtypeaudit as it was at a git revision (its package extracted
under benchmarks/_work), for before/after figures from one run.

    python benchmarks/bench_dequant.py              # ~2 GB
    python benchmarks/bench_dequant.py --layers 4   # a quick ~0.4 GB run
    python benchmarks/bench_dequant.py --also main  # and the same convert as main has it
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import WORK, Run, python, run_once

ROOT = Path(__file__).resolve().parent.parent

NAIVE = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file

def weight_dequant(x, s, block_size=128):
    # the CPU port of fp8_cast_bf16.py's weight_dequant kernel: one block at a time
    M, N = x.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    for i in range(0, M, block_size):
        for j in range(0, N, block_size):
            block = x[i:i + block_size, j:j + block_size].float() * s[i // block_size, j // block_size]
            y[i:i + block_size, j:j + block_size] = block.to(torch.bfloat16)
    return y

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for shard in sorted(src.glob("*.safetensors")):
    state = load_file(shard)
    new = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            new[name] = weight_dequant(t, state[name + "_scale_inv"])
        else:
            new[name] = t
    save_file(new, out / shard.name, metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config.pop("quantization_config", None)
config["torch_dtype"] = "bfloat16"
(out / "config.json").write_text(json.dumps(config))
"""


def make_fp8_checkpoint(path: Path, *, hidden: int, layers: int, vocab: int = 32000) -> Path:
    """Made in a child process, so that this one (whose children are measured) stays small."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, __file__, "--make", str(path), str(hidden), str(layers), str(vocab)], check=True)
    return path


def _write_fp8(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()}

    def fp8(name: str, rows: int, cols: int) -> None:
        state[name] = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[name + "_scale_inv"] = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 1e-4 + 1e-5

    for i in range(layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            fp8(f"{p}.self_attn.{name}.weight", hidden, hidden)
        state[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        fp8(f"{p}.mlp.gate_proj.weight", 4 * hidden, hidden)
        fp8(f"{p}.mlp.up_proj.weight", 4 * hidden, hidden)
        fp8(f"{p}.mlp.down_proj.weight", hidden, 4 * hidden)
    state["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    state["lm_head.weight"] = (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(path)


def package_at(rev: str) -> Path:
    """dtypeaudit's package as it was at git revision ``rev``, extracted once under benchmarks/_work."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    where = WORK / f"rev-{commit}"
    if not (where / "dtypeaudit").is_dir():
        where.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run([*git, "archive", commit, "dtypeaudit"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def ours(package: Path, src: Path, out: Path) -> list[str]:
    """``dtypeaudit convert`` from the package under ``package``, whatever PYTHONPATH says."""
    argv = ["dtypeaudit", "convert", str(src), "--to", "bf16", "-o", str(out), "--force"]
    code = f"import sys; sys.path.insert(0, {str(package)!r}); sys.argv = {argv!r}; from dtypeaudit.entry import main; main()"
    return [python(), "-c", code]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=28, help="28 layers of hidden 2048: 2.1 GB")
    parser.add_argument("--also", metavar="REV", help="also run dtypeaudit as it was at this git revision")
    args = parser.parse_args()
    src = make_fp8_checkpoint(WORK / f"fp8_h{args.hidden}_l{args.layers}", hidden=args.hidden, layers=args.layers)
    ours_out, naive_out = WORK / "dequant_ours", WORK / "dequant_naive"
    shard = "model.safetensors"
    for d in (ours_out, naive_out):
        shutil.rmtree(d, ignore_errors=True)
    naive_cmd = [python(), "-c", NAIVE, str(src), str(naive_out)]
    synced_cmd = [python(), "-c", NAIVE + "import os\nos.sync()\n", str(src), str(naive_out)]
    commands = {
        "naive": (naive_cmd, naive_out / shard),
        "synced": (synced_cmd, naive_out / shard),
        "ours": (ours(ROOT, src, ours_out), ours_out / shard),
    }
    labels = {
        "naive": "naive load_file + block loop + save_file",
        "synced": "the same, then os.sync()",
        "ours": "dtypeaudit convert --to bf16",
    }
    if args.also:
        commands["also"] = (ours(package_at(args.also), src, ours_out), ours_out / shard)
        labels["also"] = f"dtypeaudit convert at {args.also}"
    # interleaved (A B C, A B C, ...) so that a drifting machine touches each alike
    runs: dict[str, list[Run]] = {label: [] for label in commands}
    outputs = [output for _, output in commands.values()]
    for _ in range(args.repeat):
        for label, (cmd, output) in commands.items():
            runs[label].append(run_once(cmd, output, outputs))
    wall = {k: statistics.median(r.wall_s for r in rs) for k, rs in runs.items()}
    cpu = {k: statistics.median(r.cpu_s for r in rs) for k, rs in runs.items()}
    rss = {k: max(r.peak_rss_mb for r in rs) for k, rs in runs.items()}
    anon = {k: max(r.peak_anon_mb for r in rs) for k, rs in runs.items()}
    size = (src / shard).stat().st_size
    written = max(r.output_bytes for r in runs["ours"])
    print(f"checkpoint: {src.name} ({size / 1e9:.2f} GB fp8 -> {written / 1e9:.2f} GB bf16), {args.repeat} runs each, medians")
    print(f"{'':42}{'wall s':>8}{'CPU s':>8}{'peak RSS MB':>13}{'peak anon MB':>14}")
    for k, label in labels.items():
        print(f"{label:42}{wall[k]:8.2f}{cpu[k]:8.2f}{rss[k]:13.0f}{anon[k]:14.0f}")

    def paired(k: str, base: str, what: str) -> float:
        """The median over rounds of the ratio within each round: the load drifts less within a round."""
        return statistics.median(getattr(a, what) / getattr(b, what) for a, b in zip(runs[k], runs[base], strict=True))

    for k in [k for k in ("ours", "also") if k in runs]:
        print(f"{labels[k]} (medians of per-round ratios):")
        synced = paired(k, "synced", "wall_s")
        print(f"  wall {paired(k, 'naive', 'wall_s'):.3f}x the script (target <= 0.5x), {synced:.3f}x the synced script")
        print(f"  CPU {paired(k, 'naive', 'cpu_s'):.3f}x the script; peak anon memory {anon[k] / anon['naive']:.3f}x (target <= 0.25x)")
    for what in ("wall_s", "cpu_s"):
        print(f"each round's {what}: " + "; ".join(f"{k} " + " ".join(f"{getattr(r, what):.1f}" for r in rs) for k, rs in runs.items()))
    for d in (ours_out, naive_out):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--make":
        _write_fp8(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
