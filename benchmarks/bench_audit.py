"""dtypeaudit.audit on a 7B-parameter model built on the meta device, against the loop a user writes today.

Baseline: ``collections.Counter(str(t.dtype) for t in model.state_dict().values())``, which checks nothing.
Targets (issue 13): under a second, and no memory proportional to the model (25 GiB of float32 weights here).
In one process, since the model lives in memory: medians of --repeat runs, tracemalloc's peak, and the
resident set before and after.

    python benchmarks/bench_audit.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections import Counter


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import dtypeaudit

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    policy = dtypeaudit.load_policy("fp32")

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        runs = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    baseline = timed(lambda: Counter(str(t.dtype) for t in model.state_dict().values()))
    dtypeaudit.audit(model, policy, target="h100")  # warm: imports, compiled matchers
    before = rss_mb()
    ours = timed(lambda: dtypeaudit.audit(model, policy, target="h100"))
    after = rss_mb()
    tracemalloc.start()
    dtypeaudit.audit(model, policy, target="h100")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"model: Llama 7B shapes on meta, {params / 1e9:.2f}B parameters ({params * 4 / 2**30:.0f} GiB as float32)")
    print(f"state_dict dtype loop (baseline): {baseline * 1000:7.1f} ms")
    print(f"dtypeaudit.audit (policy + h100): {ours * 1000:7.1f} ms  ({ours / baseline:.1f}x the loop, target < 1 s)")
    print(f"tracemalloc peak during audit:    {peak / 2**20:7.2f} MiB")
    print(f"RSS across {args.repeat} audits:          {after - before:+7.1f} MiB")


if __name__ == "__main__":
    main()
