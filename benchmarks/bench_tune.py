"""dtypeaudit.tune against a one-module-at-a-time search, on the planted models of tests/test_tune.py.

The baseline grows a keep set the way segment searches do (onnxconverter-common's auto_mixed_precision, Polygraphy's
"first N layers"): each called module in model order is added in turn, one forward pass per try, kept unless it makes
the error worse, until the model passes. Both apply keep sets the same way (``tuning.keep``'s definition), so only the
search differs. Wall time is also given as a ratio to one fp32 forward pass of the model.

    PYTHONPATH=. python benchmarks/bench_tune.py
"""

from __future__ import annotations

import time

import torch

from dtypeaudit.tuning import tune
from dtypeaudit.tuning.search import _LowModel, keepable, low_copy
from tests.test_tune import AttentionModel, DeepStack, FeedForwardModel, OffsetModel, batch, seeded


def one_at_a_time(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, tolerance: float) -> tuple[list[str], int, float]:
    from dtypeaudit.tuning.metrics import max_abs_rel

    start = time.perf_counter()
    with torch.no_grad():
        reference = model(x)
        runner = _LowModel(model, low_copy(model, dtype).eval(), dtype)
        passes = 1
        error = max_abs_rel(runner.run((x,), {}), reference)
        passes += 1
        keep: list[str] = []
        called: list[str] = []
        hooks = [m.register_forward_hook(lambda _m, _a, _o, n=n: called.append(n)) for n, m in model.named_modules() if n]
        model(x)
        for h in hooks:
            h.remove()
        order = list(dict.fromkeys(reversed(called)))[::-1]  # each module once, in the order it finished
        for name in order:
            if error <= tolerance:
                break
            runner.set_keep([*keep, name])
            trial = max_abs_rel(runner.run((x,), {}), reference)
            passes += 1
            if trial <= error:
                keep, error = [*keep, name], trial
            else:
                runner.set_keep(keep)
    from dtypeaudit.tuning.keep import outermost

    return outermost(keep), passes, time.perf_counter() - start


def fp32_pass(model: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        model(x)
        start = time.perf_counter()
        for _ in range(5):
            model(x)
    return (time.perf_counter() - start) / 5


def main() -> None:
    cases = [
        ("feed-forward (fp16)", seeded(FeedForwardModel, 1e5), "fp16"),
        ("unscaled attention (fp16)", seeded(AttentionModel, 400.0), "fp16"),
        ("offset (bf16)", seeded(OffsetModel), "bf16"),
        ("24 blocks, 2 planted (fp16)", seeded(DeepStack, 24, (5, 17), 1e5), "fp16"),
        ("96 blocks, 3 planted (fp16)", seeded(DeepStack, 96, (10, 50, 90), 1e5), "fp16"),
    ]
    print(
        f"{'model':30} {'modules':>7} {'tune passes':>11} {'tune s':>7} {'x fp32':>7} {'keep':>4} |"
        f" {'1-by-1 passes':>13} {'1-by-1 s':>8} {'keep':>4}"
    )
    for label, model, to in cases:
        x = batch()
        dtype = torch.float16 if to == "fp16" else torch.bfloat16
        unit = fp32_pass(model, x)
        start = time.perf_counter()
        result = tune(model, x, to=to, tolerance=1e-2)
        took = time.perf_counter() - start
        keep, passes, base = one_at_a_time(model, x, dtype, 1e-2)
        called = sum(1 for m in result.modules if m.calls)
        assert all(keepable(k, {m.name: m for m in result.modules}) for k in result.keep)
        print(
            f"{label:30} {called:>7} {result.forward_passes:>11} {took:>7.2f} {took / unit:>7.0f} {len(result.keep):>4} |"
            f" {passes:>13} {base:>8.2f} {len(keep):>4}"
        )


if __name__ == "__main__":
    main()
