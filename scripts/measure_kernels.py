"""Measure what PyTorch's CPU kernels do with each dtype combination, on this machine, into
``dtypeaudit/data/kernels.json`` (``dtypeaudit.kernels`` reads it).

    python scripts/measure_kernels.py                              # this machine's backend, as it runs by default
    ATEN_CPU_CAPABILITY=default python scripts/measure_kernels.py  # ATen's scalar kernels
    python scripts/measure_kernels.py --no-onednn                  # oneDNN (mkldnn) switched off

The cases are ``tests/kernel_cases.py`` (``tests/test_runtime_truth.py`` runs them too). A run replaces this
backend's rows and its record of where, on which torch and how it was measured; the other backends are kept.
The file holds one base table (each row's outcome on most backends) and, per backend, only what sets it apart:
the rows where it differs and the rows it did not measure, or, where that is shorter, its rows alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the cases live in tests/, the reader in dtypeaudit/, whatever the working directory

TABLE = ROOT / "dtypeaudit" / "data" / "kernels.json"
ABOUT = (
    "What PyTorch kernels did with each dtype combination, per backend, and where each backend was measured. "
    "Written by scripts/measure_kernels.py; dtypeaudit/kernels.py reads it."
)


def machine() -> str:
    """The CPU model and its vector extensions, for the record of where a backend was measured."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = " ".join(sorted(f for f in value.split() if re.match(r"(avx|amx|f16c|fma)", f)))
    except OSError:
        pass
    return f"{model} ({flags})" if flags else model


def measure() -> dict[str, str]:
    """Row key -> outcome on this process's backend, for every case whose failure is about dtypes."""
    from tests import kernel_cases

    out = {}
    for name, x, combo in kernel_cases.kernel_cases():
        outcome = kernel_cases.run_case(name, x, combo)
        if outcome.limitation is None:
            out[kernel_cases.row_key(name, x, combo)] = outcome.entry
    return out


def compact(backends: dict[str, dict[str, str]], outcomes: dict[str, dict[str, str]]) -> dict[str, object]:
    """The file's content for these backends (their records) and rows; ``dtypeaudit.kernels.expand`` inverts it.

    The base row is the outcome most backends measured (ties: the first in sorted order), so a backend that
    agrees with the others costs nothing but its record.
    """
    seen: dict[str, list[str]] = {}
    for rows in outcomes.values():
        for key, entry in rows.items():
            seen.setdefault(key, []).append(entry)
    base = {key: Counter(sorted(entries)).most_common(1)[0][0] for key, entries in sorted(seen.items())}
    out: dict[str, dict[str, object]] = {}
    for backend in sorted(backends):
        rows = outcomes.get(backend, {})
        differs = {k: v for k, v in sorted(rows.items()) if base[k] != v}
        unmeasured = [k for k in base if k not in rows]
        entry: dict[str, object] = dict(sorted(backends[backend].items()))
        if len(rows) < len(differs) + len(unmeasured):
            entry["only"] = dict(sorted(rows.items()))
        else:
            entry.update({"differs": differs} if differs else {})
            entry.update({"unmeasured": unmeasured} if unmeasured else {})
        out[backend] = entry
    return {"about": ABOUT, "backends": out, "base": base}


def write(doc: dict[str, object]) -> None:
    TABLE.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _native_capability() -> str:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-onednn", action="store_true", help="measure with oneDNN (mkldnn) switched off")
    args = parser.parse_args()

    import torch

    from dtypeaudit import kernels
    from tests import kernel_cases

    if args.no_onednn:
        torch.backends.mkldnn.enabled = False
    backend = kernel_cases.backend_id()
    measured = measure()
    table = kernels.expand(json.loads(TABLE.read_text(encoding="utf-8"))) if TABLE.exists() else kernels.Table({}, {})
    how = "ATEN_CPU_CAPABILITY lowered" if torch.backends.cpu.get_cpu_capability() != _native_capability() else "native"
    how += ", oneDNN off" if args.no_onednn else ""
    backends = {**table.backends, backend: {"measured_on": machine(), "torch": torch.__version__, "how": how}}
    write(compact(backends, {**table.outcomes, backend: measured}))
    print(f"{backend}: {len(measured)} rows written to {TABLE}")


if __name__ == "__main__":
    main()
