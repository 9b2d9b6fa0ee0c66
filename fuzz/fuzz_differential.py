"""Differential fuzzer: dtypeaudit's inventory against what torch itself loads, run by hand:

    python fuzz/fuzz_differential.py --cases 20000 --seed 1 [--jobs 2]
    python fuzz/fuzz_differential.py --replay 1:4711          # one case again, in this process, with both views
    python fuzz/fuzz_differential.py --dirs --cases 200 --seed 1  # random HF / DCP folders (fuzz/dir_cases.py)

Each case is a checkpoint torch.save (zip or legacy, pickle protocols 0-5) or safetensors writes, from a
seeded generator, often with one structural mutation of its pickle, its zip directory or its safetensors
header (see tests/diff_oracle.py). The reference is torch.load(weights_only=True), or where that refuses,
torch.load with CPython's unpickler behind an allowlist; a .safetensors path goes where torch.load sends it.
Cases run in worker processes with a memory cap, so a hang (over 10 s in dtypeaudit) or a death is a verdict.

Every DIFFERENTIAL (both read, inventories differ) and CRASH (an exception other than DtypeAuditError, or a
hang) is saved under fuzz/differentials/ with a line in its index.tsv; each should become a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _class_key(result: dict[str, Any]) -> str:
    v = result["verdict"]
    family = str(result.get("family", "?")).split("-p")[0]
    return f"{v['outcome']} {family} {result.get('mutation', '?')} {v.get('subclass', '')}".strip()


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.by_family: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.by_mutation: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.classes: dict[str, dict[str, Any]] = {}
        self.known: Counter[str] = Counter()
        self.ref_how: Counter[str] = Counter()
        self.done = 0

    def add(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """Count one result; return its class record when it is DIFFERENTIAL/CRASH/ORACLE-FAILED."""
        from tests.diff_oracle import BAD_OUTCOMES, ORACLE_FAILED

        outcome = result["verdict"]["outcome"]
        family = str(result.get("family", "?"))
        mutation = str(result.get("mutation", "?"))
        with self.lock:
            self.done += 1
            self.outcomes[outcome] += 1
            self.by_family[(family, mutation.split(":")[0])][outcome] += 1
            self.by_mutation[mutation][outcome] += 1
            self.ref_how[result.get("ref_how", "?")] += 1
            if result.get("known"):
                self.known[f"{outcome} {result['known']}"] += 1
            if outcome not in BAD_OUTCOMES and outcome != ORACLE_FAILED:
                return None
            key = _class_key(result)
            record = self.classes.setdefault(key, {"count": 0, "first": result, "known": result.get("known", "")})
            record["count"] += 1
            return record


def table(rows: dict[Any, Counter[str]], label: str) -> str:
    from tests.diff_oracle import OUTCOMES

    cols = [o for o in OUTCOMES if any(c[o] for c in rows.values())]
    width = max([len(label), *(len(" ".join(k) if isinstance(k, tuple) else str(k)) for k in rows)]) + 2
    head = label.ljust(width) + "".join(c[:12].rjust(13) for c in cols) + "total".rjust(8)
    lines = [head, "-" * len(head)]
    for key in sorted(rows):
        c = rows[key]
        name = " ".join(key) if isinstance(key, tuple) else str(key)
        lines.append(name.ljust(width) + "".join(str(c[o] or "").rjust(13) for o in cols) + str(sum(c.values())).rjust(8))
    return "\n".join(lines)


def replay(key: str, out: Path | None) -> int:
    from tests import diff_oracle as d

    seed, index, *rest = key.split(":", 2)
    pins: dict[str, Any] = {}
    for part in (rest[0] if rest else "").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            name = {"c": "container", "p": "protocol", "g": "generator", "m": "mutation"}[k]
            pins[name] = int(v) if name == "protocol" else v
    case = d.make_case(int(seed) if seed.lstrip("-").isdigit() else seed, int(index), **pins)
    with tempfile.TemporaryDirectory() as tmp:
        verdict, ref, ours = d.evaluate(case, Path(tmp))
        if out is not None:
            shutil.copyfile(Path(tmp) / f"case{case.suffix}", out)
    print(f"case {case.key}: {case.description}")
    print(f"verdict: {verdict.outcome} {verdict.subclass}\n  {verdict.detail}")
    print(f"torch ({ref.how}, {ref.status}) {ref.error}")
    for e in sorted(ref.entries, key=repr):
        print("   ", e)
    print(f"dtypeaudit ({ours.status}) {ours.error.strip()[-2000:]} errors={list(ours.error_findings)}")
    for e in sorted(ours.entries, key=repr):
        print("   ", e)
    if out is not None:
        print(f"input written to {out}")
    return 0


def run_dirs(args: argparse.Namespace) -> int:
    """The directory mode: cases one after another in this process (each writes and loads a folder, ~1 s);
    a case whose verdict is not AGREE keeps its folder under --out and is printed with its seed."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.disable(logging.WARNING)
    sys.path.insert(0, str(HERE))
    import dir_cases

    base = int(args.seed) if args.seed.lstrip("-").isdigit() else abs(hash(args.seed)) % (1 << 31)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    outcomes: Counter[str] = Counter()
    t0 = time.monotonic()
    for i in range(args.start, args.start + args.cases):
        result = dir_cases.run_case(base * 1_000_003 + i, args.kind, keep=out)
        outcomes[result["verdict"]] += 1
        if result["verdict"] != "AGREE":
            print(f"{result['verdict']} seed {result['seed']} {result['planted']}\n  loader: {str(result['reference'])[:300]}"
                  f"\n  dtypeaudit: {str(result['ours'])[:300]}", flush=True)  # fmt: skip
        if args.log is not None:
            with args.log.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(result, default=str) + "\n")
    elapsed = time.monotonic() - t0
    print(f"{sum(outcomes.values())} folders in {elapsed:.1f} s: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    return 0 if set(outcomes) <= {"AGREE"} else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--start", type=int, default=0, help="first case index (to split one seed's run in parts)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each one case at a time)")
    parser.add_argument("--out", type=Path, default=HERE / "differentials")
    parser.add_argument("--container", choices=["zip", "legacy", "safetensors"])
    parser.add_argument("--protocol", type=int, choices=range(6))
    parser.add_argument("--generator", choices=["nested", "odd", "state_dict", "training", "params", "safetensors"])
    parser.add_argument("--mutation", help="pin a mutation: none, pickle:<op>, zip:<op>, st:<op>, bytes:pickle, confusion:<op>")
    parser.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--replay", metavar="SEED:INDEX[:pins]", help="run one case in this process and show both views")
    parser.add_argument("--write", type=Path, help="with --replay: copy the input there")
    parser.add_argument("--log", type=Path, help="append every result (JSON lines) to this file")
    parser.add_argument("--dirs", action="store_true", help="directory mode: random HF and DCP folders against from_pretrained / DCP")
    parser.add_argument("--kind", choices=["hf", "dcp"], help="with --dirs: only this kind of folder")
    args = parser.parse_args()
    if args.replay:
        return replay(args.replay, args.write)
    if args.dirs:
        return run_dirs(args)

    from tests.diff_oracle import Runner

    pins = {
        k: v
        for k, v in (("container", args.container), ("protocol", args.protocol), ("generator", args.generator), ("mutation", args.mutation))
        if v is not None
    }
    seed: int | str = int(args.seed) if args.seed.lstrip("-").isdigit() else args.seed
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ignore = out / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# written by fuzz/fuzz_differential.py: inputs are reproducible from their keys\n*\n")
    index_file = out / "index.tsv"
    log: Path | None = args.log
    stats = Stats()
    next_index = iter(range(args.start, args.start + args.cases))
    take = threading.Lock()
    write = threading.Lock()
    t0 = time.monotonic()

    def save(result: dict[str, Any], record: dict[str, Any]) -> None:
        v = result["verdict"]
        src = result.get("path") or result.get("saved")
        name = (
            f"{v['outcome'].lower()}-{str(result['key']).replace(':', '_').replace('=', '-').replace(',', '_')}{result.get('suffix', '')}"
        )
        with write:
            if src and Path(src).exists():
                shutil.copyfile(src, out / name)
            line = "\t".join(
                str(x).replace("\t", " ").replace("\n", " ")
                for x in (name, v["outcome"], v.get("subclass", ""), result.get("known", ""), result["key"], result.get("mutation", ""),
                          result.get("description", ""), v.get("detail", ""))
            )  # fmt: skip
            with index_file.open("a", encoding="utf-8", errors="backslashreplace") as fh:
                fh.write(line + "\n")
            if record["count"] == 1:
                print(
                    f"new class [{_class_key(result)}] {result['key']}: {result.get('description', '')}\n    {v.get('detail', '')[:400]}",
                    flush=True,
                )

    def work() -> None:
        with Runner(keep_dir=out) as runner:
            while True:
                with take:
                    i = next(next_index, None)
                if i is None:
                    return
                result = runner.run(seed, i, **pins)
                record = stats.add(result)
                if log is not None:
                    with write, log.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(result) + "\n")
                if record is not None:
                    save(result, record)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    last = time.monotonic()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=1.0)
        if time.monotonic() - last >= args.progress:
            last = time.monotonic()
            elapsed = last - t0
            print(
                f"[{elapsed:7.0f} s] {stats.done}/{args.cases} cases, {stats.done / elapsed:.1f}/s, {dict(stats.outcomes)}",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.monotonic() - t0
    print()
    print(table(dict(stats.by_family), "generator / mutation family"))
    print()
    print(table(dict(stats.by_mutation), "mutation"))
    print()
    print(f"{stats.done} cases in {elapsed:.1f} s: {stats.done / elapsed:.1f} cases/s with {args.jobs} job(s), seed {seed}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in stats.outcomes.most_common()))
    print("reference loader: " + ", ".join(f"{k} {v}" for k, v in stats.ref_how.most_common()))
    if stats.known:
        print("known-issue hints: " + ", ".join(f"{k} {v}" for k, v in stats.known.most_common()))
    if stats.classes:
        print("\nclasses (DIFFERENTIAL / CRASH / ORACLE-FAILED), with the first case of each:")
        for key, rec in sorted(stats.classes.items(), key=lambda kv: -kv[1]["count"]):
            first = rec["first"]
            known = f" (known: {rec['known']})" if rec["known"] else ""
            print(f"  {rec['count']:6d}  {key}{known}")
            print(f"          {first['key']}: {first.get('description', '')}")
            print(f"          {first['verdict'].get('detail', '')[:300]}")
    summary = {
        "seed": seed,
        "start": args.start,
        "cases": stats.done,
        "seconds": elapsed,
        "rate": stats.done / elapsed if elapsed else 0,
        "jobs": args.jobs,
        "outcomes": dict(stats.outcomes),
        "classes": {k: {"count": r["count"], "known": r["known"], "first": r["first"]["key"]} for k, r in stats.classes.items()},
    }
    (out / f"summary-{seed}-{args.start}.json").write_text(json.dumps(summary, indent=1))
    return 1 if stats.classes else 0


if __name__ == "__main__":
    sys.exit(main())
