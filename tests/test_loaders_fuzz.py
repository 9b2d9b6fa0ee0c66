"""The differential fuzzer's directory mode (fuzz/dir_cases.py) as tests: random Hugging Face and DCP folders
written by the real writers, compared with from_pretrained / dcp_to_torch_save; a planted payload must be
reported and never run."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import dir_cases  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _check(result: dict[str, Any]) -> None:
    assert result["verdict"] == "AGREE", (result["seed"], result["planted"], result["reference"], result["ours"])


@pytest.mark.parametrize(("seed", "kind"), [(5, "hf"), (11, "hf"), (3, "dcp")])
def test_random_folders_agree_with_the_loaders(seed: int, kind: str) -> None:
    _check(dir_cases.run_case(seed, kind))


@pytest.mark.parametrize(("seed", "kind"), [(8, "hf"), (9, "dcp")])
def test_a_planted_payload_is_reported_and_never_runs(seed: int, kind: str) -> None:
    result = dir_cases.run_case(seed, kind, payload=True)
    assert result["planted"]["payload"] and isinstance(result["ours"], dict)  # read, not refused: the payload had to be found
    _check(result)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(4))
def test_many_random_folders_agree(block: int) -> None:
    for i in range(15):
        _check(dir_cases.run_case(10_000 + block * 100 + i))
