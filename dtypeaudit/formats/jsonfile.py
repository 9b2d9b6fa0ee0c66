"""JSON from files we do not trust: a key written twice is an error, not a silent overwrite."""

from __future__ import annotations

import json
from typing import Any

from ..errors import LimitExceeded

MAX_JSON_BYTES = 64 << 20
"""One cap for every JSON file a checkpoint brings (config.json, an index), whoever parses it."""


def within_json_cap(path: Any) -> None:
    """Refuse a JSON file over the cap before anything parses it (ours, or transformers' for ``--model``)."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise LimitExceeded("JSON file is over the 64 MiB cap", path=str(path))


class DuplicateKey(ValueError):
    """A JSON object names ``key`` twice; json.loads would keep the last one without a word."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` that refuses a key written twice (readers disagree on which one counts)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def loads_unique(text: str) -> Any:
    """``json.loads`` that raises DuplicateKey instead of keeping the last of two equal keys."""
    return json.loads(text, object_pairs_hook=unique_pairs)
