"""dtypeaudit trace on a Llama-style 7B config, forward and backward, as whole processes.

Target (issue 11): under 60 s and under 2 GB of peak RSS on the 2-core development machine. The model is
transformers' LlamaConfig at 7B sizes (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000),
built on the meta device and run on fake tensors: a real forward and backward of it would need about 28 GB
of float32 weights and as much again for gradients, so there is no run to compare with; the floor shown is
``python -c "import torch, transformers"``, which every trace pays first.

    python benchmarks/bench_trace.py              # writes benchmarks/_work/llama7b/config.json
    python benchmarks/bench_trace.py --repeat 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import WORK, measure, python

CONFIG = (
    "import sys, transformers\n"
    "c = transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,\n"
    "    intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, architectures=['LlamaForCausalLM'])\n"
    "c.save_pretrained(sys.argv[1])\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128, help="sequence length of input_ids (default 128)")
    args = parser.parse_args()
    config_dir = WORK / "llama7b"
    if not (config_dir / "config.json").exists():
        subprocess.run([python(), "-c", CONFIG, str(config_dir)], check=True)
    out = WORK / "llama7b.trace.json"
    base = [python(), "-m", "dtypeaudit", "trace", str(config_dir), "--input", f"input_ids=1x{args.seq}:int64"]
    runs = {
        "import torch, transformers (floor)": measure([python(), "-c", "import torch, transformers"], repeat=args.repeat),
        "trace, forward": measure([*base, "--format", "json", "-o", str(out)], repeat=args.repeat, output=out),
        "trace, forward+backward": measure([*base, "--backward", "--format", "json", "-o", str(out)], repeat=args.repeat, output=out),
        "trace, forward+backward, autocast bf16": measure(
            [*base, "--backward", "--autocast", "bf16", "--format", "json", "-o", str(out)], repeat=args.repeat, output=out
        ),
    }
    subprocess.run([*base, "--backward", "--format", "json", "-o", str(out)], check=False, capture_output=True)
    doc = json.loads(out.read_text())
    trace = doc["checkpoints"][0]["trace"]
    params = sum(t["numel"] for t in doc["checkpoints"][0]["tensors"] if t["kind"] == "parameter")
    print(f"model: {trace['model']}, {params / 1e9:.2f}B parameters, input_ids 1x{args.seq}")
    print(f"forward+backward: {trace['ops_total']} operations, report {out.stat().st_size / 1e6:.1f} MB of JSON")
    print(f"{'':42}{'wall s':>10}{'peak RSS MB':>14}")
    for label, m in runs.items():
        print(f"{label:42}{m.wall_s:10.2f}{m.peak_rss_mb:14.0f}")
    worst = max(runs.values(), key=lambda m: m.wall_s)
    ok = worst.wall_s < 60 and max(m.peak_rss_mb for m in runs.values()) < 2048
    print(f"target: < 60 s and < 2 GB: {'met' if ok else 'MISSED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
