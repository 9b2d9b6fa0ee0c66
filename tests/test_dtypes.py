"""Our dtype table agrees with torch on every dtype torch defines."""

from __future__ import annotations

import torch

from dtypeaudit import dtypes


def test_table_matches_torch() -> None:
    torch_dtypes = {str(v)[6:]: v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert set(torch_dtypes) == set(dtypes.DTYPES)
    for name, d in torch_dtypes.items():
        ours = dtypes.get(name)
        assert ours.itemsize == d.itemsize, name
        assert ours.is_floating == d.is_floating_point, name
        assert (ours.family == "complex") == d.is_complex, name


def test_storage_classes_name_torch_classes() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cls, name in dtypes.STORAGE_CLASSES.items():
            assert getattr(torch, cls).dtype == getattr(torch, name)


def test_aliases() -> None:
    assert [dtypes.canonical(s) for s in ("fp16", "half", "BF16", "torch.float32", "double", "fp8")] == [
        "float16",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        None,
    ]
