"""The differential fuzzer's quantized mode (fuzz/quant_cases.py) as tests: random FP8 / MXFP8, MXFP4, compressed-tensors
and bitsandbytes folders written by the real writers, against from_pretrained on CPU (dequantize=True),
compressed-tensors' decompress and bitsandbytes' dequantize: scan's loaded dtypes and convert's values.

Any difference fails, but one of a class listed in ``quant_cases.KNOWN`` (known and not fixed yet), which is an
xfail naming it; the list is empty (issue 31's quantized classes are fixed, tests/test_quant_edges.py holds each).
``python fuzz/quant_cases.py --cases 300`` runs a sweep."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import quant_cases  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("transformers", "compressed_tensors", "bitsandbytes")),
        reason="needs transformers, compressed-tensors and bitsandbytes",
    ),
]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _verdict(seed: int, scheme: str | None = None) -> str | None:
    """None where the case agrees, the known class where it differs by one; an unknown difference fails."""
    result = quant_cases.run_case(seed, scheme)
    if not result["classes"]:
        return None
    known = quant_cases.known_class(result)
    if known is None:
        raise AssertionError(f"seed {seed}: {result['scheme']} {result['params']}: {result['classes']} (reference: {result['reference']})")
    return known


@pytest.mark.parametrize("scheme", quant_cases.SCHEMES)
@pytest.mark.parametrize("seed", range(8))
def test_random_quantized_folders_agree_with_their_loaders(scheme: str, seed: int) -> None:
    known = _verdict(20_000 + seed, scheme)
    if known is not None:
        pytest.xfail(f"known class: {known}")


@pytest.mark.parametrize("block", range(4))
def test_many_random_quantized_folders(block: int) -> None:
    """Every case of the block is run; the block is an xfail naming the known classes it met, a failure at the
    first unknown difference."""
    known = {c for i in range(25) if (k := _verdict(30_000 + block * 25 + i)) is not None for c in k.split("; ")}
    if known:
        pytest.xfail(f"known classes: {'; '.join(sorted(known))}")
