"""``policy init``: a policy that a checkpoint passes exactly, folded into patterns where dtypes are uniform."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache

import yaml

from . import dtypes
from .inventory import Inventory, TensorRecord
from .policy import Matcher, compile_matcher

_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def _is_floating(t: TensorRecord) -> bool:
    return dtypes.is_floating(t.dtype)


def _literal(name: str) -> str:
    """A pattern for exactly ``name``: anchored with ``^``, since a glob also matches tails after a dot."""
    return f"re:^{re.escape(name)}$" if any(c in name for c in "*?[]^") or name.startswith("re:") else f"^{name}"


def _candidates(name: str) -> Iterator[str]:
    """Patterns for ``name``, broadest first.

    The name itself comes before its anchored form: a glob also matches the name under any prefix, so the
    policy written from a bare state_dict holds the same model inside a wrapper (Lightning's
    ``state_dict.net.``, DDP's ``module.``). ``baseline`` anchors it only where the bare glob would claim a
    tensor of another dtype in this checkpoint.
    """
    parts = name.split(".")
    if len(parts) > 1:
        yield "*." + parts[-1]
    if len(parts) > 2:
        yield "*." + _DIGITS.sub("*", ".".join(parts[-2:]))
    starred = _DIGITS.sub("*", name)
    if starred != name:
        yield starred
    if not any(c in name for c in "*?[]^") and not name.startswith("re:"):
        yield name
    yield _literal(name)


@lru_cache(maxsize=4096)
def _matcher(pattern: str) -> Matcher:
    return compile_matcher(pattern)


def _matches(pattern: str, name: str) -> bool:
    """As the policy will match it (globs on dotted-name boundaries)."""
    return _matcher(pattern)(name)


def baseline(inv: Inventory) -> dict[str, object]:
    """The policy as data: default = the commonest floating dtype, one rule per other dtype. Written for the tensors
    as a policy sees them (quantized weights as their logical weights, a folder's dtypes as from_pretrained loads
    them), so that the checkpoint passes its own baseline."""
    from .checks import as_policies_see_it

    tensors = as_policies_see_it(inv)
    floating = [t for t in tensors if _is_floating(t)]
    counts = Counter(t.dtype for t in floating)
    default = max(counts, key=lambda d: (counts[d], d)) if counts else None
    patterns: dict[str, list[str]] = {}
    for t in tensors:
        if t.dtype == default and _is_floating(t):
            continue
        covered = patterns.get(t.dtype, [])
        if any(_matches(p, t.name) for p in covered):
            continue
        for pattern in _candidates(t.name):
            claimed = [o for o in tensors if _matches(pattern, o.name)]
            if all(o.dtype == t.dtype for o in claimed):
                patterns.setdefault(t.dtype, []).append(pattern)
                break
    policy: dict[str, object] = {"version": 1}
    if default is not None:
        policy["default"] = default
    policy["check_integers"] = True
    rules: list[dict[str, object]] = [
        {"name": f"baseline-{dtype}", "match": pats if len(pats) > 1 else pats[0], "dtype": dtype} for dtype, pats in patterns.items()
    ]
    if not any(t.region == "optimizer" for t in tensors):
        # Nothing here says what an optimizer's state should be: the same model in a training checkpoint
        # (Adam moments in each parameter's dtype, float32 steps) must not fail on state this file never had.
        rules.insert(0, OPTIMIZER_UNBASELINED)
    policy["rules"] = rules
    return policy


OPTIMIZER_UNBASELINED: dict[str, object] = {
    "name": "optimizer-not-baselined",
    "region": "optimizer",
    "dtype": "any",
    "optional": True,
    "reason": "the baselined checkpoint holds no optimizer state",
}


def render_baseline(inv: Inventory) -> str:
    header = (
        f"# Baseline for {inv.path} ({inv.format}, {len(inv.tensors)} tensors), written by `dtypeaudit policy init`.\n"
        "# The checkpoint passes it exactly. Loosen what may change, then check with\n"
        "#   dtypeaudit scan CHECKPOINT --policy THIS_FILE\n"
        "# For a security-sensitive gate, add `strict: true`: anything a loader might read differently\n"
        "# from dtypeaudit (foreign globals, trailing data, unused weight files) then fails the scan.\n"
    )
    return header + yaml.safe_dump(baseline(inv), sort_keys=False, width=120)
