"""Our dtype table agrees with torch on every dtype torch defines."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_safetensors_codes_are_the_crates(tmp_path: Path) -> None:
    """The crate names its whole Dtype enum when it refuses an unknown code: ours is exactly that list."""
    import json
    import re
    import struct

    from safetensors import safe_open

    header = json.dumps({"t": {"dtype": "NOT_A_DTYPE", "shape": [0], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    try:
        safe_open(str(path), "pt")
    except Exception as exc:  # noqa: BLE001 - the crate's own error type
        listed = set(re.findall(r"`(\w+)`", str(exc).split("expected one of", 1)[1]))
    else:
        raise AssertionError("the crate accepted an unknown dtype")
    assert listed == set(dtypes.SAFETENSORS_CODES) | dtypes.SAFETENSORS_TORCHLESS
    for code in listed - dtypes.SAFETENSORS_TORCHLESS:
        assert dtypes.safetensors_bits(code) in (4, 8, 16, 32, 64), code


def test_one_parser_for_convert_to() -> None:
    from dtypeaudit.errors import UsageError

    for spelling, name in [
        ("fp16", "float16"),
        ("half", "float16"),
        ("torch.bfloat16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("float", "float32"),
    ]:
        assert dtypes.conversion_target(spelling) == name
    for bad in ("int8", "fp8", "float64", ""):
        with pytest.raises(UsageError, match="--to must be fp16, bf16 or fp32"):
            dtypes.conversion_target(bad)
    assert [dtypes.short_name(t) for t in ("float16", "bfloat16", "float32")] == ["fp16", "bf16", "fp32"]


def test_is_floating_agrees_with_torch() -> None:

    for name in dtypes.DTYPES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            assert dtypes.is_floating(name) == dt.is_floating_point, name
    assert not dtypes.is_floating("no-such-dtype")
    assert dtypes.CASTABLE == {n for n in dtypes.DTYPES if dtypes.is_floating(n) and dtypes.get(n).itemsize >= 2}


def test_a_torch_dtype_is_named_as_reports_name_it() -> None:
    """dtypes.name_of is the one spelling of torch's dtypes (and layouts) in reports: every dtype the package knows
    comes back under its own name from the torch object, and a layout too."""
    import torch

    from dtypeaudit import dtypes

    known = [name for name in dtypes.DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]
    assert "float16" in known and "bfloat16" in known and "float8_e4m3fn" in known
    assert [dtypes.name_of(getattr(torch, name)) for name in known] == known
    assert dtypes.name_of(torch.strided) == "strided" and dtypes.name_of(torch.sparse_coo) == "sparse_coo"
