"""dtypeaudit's start-up, as a pre-commit hook pays it: one small checkpoint, whole processes, regular install.

A venv under benchmarks/_work/startup/ gets a regular (not editable) ``pip install`` of this source tree, the
light install (no torch), plus picklescan, which needs nothing else. A small ``torch.save`` state_dict (5
tensors) is written with this interpreter's torch. Then, as whole processes, interleaved over ``--repeat``
rounds (each round in a rotated order, so that no command always runs first): ``python -c pass`` (the floor),
``picklescan -p small.pt``, ``python -c 'import typer'`` (Typer alone), ``dtypeaudit --version``,
``dtypeaudit scan small.pt -f plain`` and ``-f json`` (the Typer app, as every command line), and the same scan and
plain report run without any command line (``pipeline.scan`` and the plain renderer: what the CLI framework costs).
Median wall and CPU (user + system) time, and each command's ratio to picklescan in the same round (median over
rounds). The load average is printed next to the figures: on a loaded machine, trust the ratios and the CPU times
over the wall times. Target (issue 28): ``scan -f plain`` through Typer at most 1.5x picklescan.

    python benchmarks/bench_startup.py                    # 30 rounds
    python benchmarks/bench_startup.py --imports 15       # and where a scan's imports go (median -X importtime)
    python benchmarks/bench_startup.py --also ../other    # another source tree (a branch, a prototype) in the same rounds
    python benchmarks/bench_startup.py --split            # and the scan's start-up built up a piece at a time

The venv is reinstalled (``--no-deps --force-reinstall``) when the source tree's files change.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import WORK

ROOT = Path(__file__).resolve().parent.parent
STARTUP = WORK / "startup"


# -- the venvs --------------------------------------------------------------------------------------


def _source_hash(src: Path) -> str:
    """What a regular install copies: the package's files and pyproject.toml."""
    h = hashlib.sha256()
    files = [p for p in (src / "dtypeaudit").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for f in sorted([src / "pyproject.toml", *files]):
        h.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH (the helpers' shells point it at a worktree): each venv imports what it installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def make_venv(src: Path, name: str) -> Path:
    """A venv with a regular ``pip install SRC`` and picklescan; reinstalled when SRC changed."""
    venv = STARTUP / name
    stamp = venv / ".source-hash"
    digest = _source_hash(src)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not (venv / "bin" / "picklescan").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        # picklescan requires nothing (py7zr only for its 7z extra): it cannot pull torch in
        subprocess.run([*pip, str(src), "picklescan"], check=True, env=_clean_env())
    elif not stamp.exists() or stamp.read_text() != digest:
        subprocess.run([*pip, "--no-deps", "--force-reinstall", str(src)], check=True, env=_clean_env())
    stamp.write_text(digest)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import dtypeaudit, importlib.util as u; print(dtypeaudit.__file__, u.find_spec('torch'))"],
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=STARTUP,  # not the source tree, whose dtypeaudit/ `python -c` would import first
    ).stdout.split()
    if not where[0].startswith(str(venv)) or where[1] != "None":
        raise SystemExit(f"{venv}: dtypeaudit should come from the venv's own site-packages, without torch: {where}")
    return venv


def make_small_checkpoint(path: Path) -> Path:
    """A Linear-plus-LayerNorm state_dict and a step counter, as torch.save writes it (3 KB)."""
    if not path.exists():
        import torch

        g = torch.Generator().manual_seed(0)
        state = {
            "fc.weight": torch.randn(16, 8, generator=g),
            "fc.bias": torch.zeros(16),
            "norm.weight": torch.ones(16),
            "norm.bias": torch.zeros(16),
            "step": torch.tensor(3),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return path


def make_small_hf_folder(path: Path) -> Path:
    """A one-layer GPT-2 as save_pretrained writes it (config.json, model.safetensors): the folder a scan reads
    through the table of transformers' classes."""
    if not path.exists():
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
    return path


# -- whole-process timing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float


def run_once(cmd: list[str], env: dict[str, str]) -> Run:
    """One whole process: wall time from spawn to reap (a blocking wait4, no polling interval), and the
    user + system CPU time the kernel charged it."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=STARTUP)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}")
    return Run(wall, usage.ru_utime + usage.ru_stime)


def check_runs(commands: dict[str, list[str]], env: dict[str, str]) -> None:
    """Each command once, output shown on failure: it must exit 0 (the small checkpoint is clean)."""
    for label, cmd in commands.items():
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=STARTUP)
        if done.returncode != 0:
            raise SystemExit(f"{label}: exit {done.returncode}\n{done.stdout}{done.stderr}")


def measure_rounds(commands: dict[str, list[str]], env: dict[str, str], repeat: int) -> tuple[dict[str, list[Run]], list[float]]:
    """``repeat`` rounds of every command; round i starts at command i (mod n). The 1-minute load average
    after each round comes back with the runs."""
    labels = list(commands)
    runs: dict[str, list[Run]] = {label: [] for label in labels}
    loads = []
    for i in range(repeat):
        k = i % len(labels)
        for label in labels[k:] + labels[:k]:
            runs[label].append(run_once(commands[label], env))
        loads.append(os.getloadavg()[0])
    return runs, loads


def print_table(runs: dict[str, list[Run]], reference: str, floor: str) -> None:
    ref = runs[reference]
    w = max(len(label) for label in runs) + 2
    print(f"{'command':{w}}{'wall ms':>9}{'cpu ms':>9}{'wall/ps':>9}{'cpu/ps':>8}{'- floor':>9}")
    floor_cpu = statistics.median(r.cpu_s for r in runs[floor])
    for label, rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        cpu = statistics.median(r.cpu_s for r in rs)
        # paired: this command against picklescan in the same round, so load that drifts between rounds cancels
        wall_ratio = statistics.median(r.wall_s / p.wall_s for r, p in zip(rs, ref, strict=True))
        cpu_ratio = statistics.median(r.cpu_s / p.cpu_s for r, p in zip(rs, ref, strict=True))
        print(f"{label:{w}}{wall * 1e3:9.0f}{cpu * 1e3:9.0f}{wall_ratio:8.2f}x{cpu_ratio:7.2f}x{(cpu - floor_cpu) * 1e3:9.0f}")
    print("(medians; wall/ps and cpu/ps: median over rounds of the ratio to picklescan in the same round;")
    print(" - floor: CPU ms above `python -c pass`)")


# -- where the imports go ------------------------------------------------------------------------------


@dataclass
class Imported:
    name: str
    depth: int
    self_us: list[int]
    cumulative_us: list[int]
    parent: str | None = None


def import_profile(cmd: list[str], env: dict[str, str], repeat: int) -> dict[str, Imported]:
    """``-X importtime`` of ``cmd`` ``repeat`` times: every module with its importer (the first module one level
    up that finished after it) and its self and cumulative microseconds of each run."""
    modules: dict[str, Imported] = {}
    for _ in range(repeat):
        lines = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=STARTUP, check=True).stderr.splitlines()
        pending: list[tuple[int, str]] = []  # (depth, name) of modules whose importer has not finished yet
        for line in lines:
            if not line.startswith("import time:") or "|" not in line or "imported package" in line:
                continue
            self_us, cumulative_us, tail = line[len("import time:") :].split("|")
            name = tail.strip()
            depth = (len(tail) - len(tail.lstrip()) - 1) // 2
            m = modules.setdefault(name, Imported(name, depth, [], []))
            m.self_us.append(int(self_us))
            m.cumulative_us.append(int(cumulative_us))
            # importtime prints a module after everything it imported: the children are the pending deeper ones
            while pending and pending[-1][0] > depth:
                modules[pending.pop()[1]].parent = name
            pending.append((depth, name))
    return modules


def _ms(us: list[int]) -> float:
    return statistics.median(us) / 1e3 if us else 0.0


def print_imports(modules: dict[str, Imported], top: int) -> None:
    total = sum(_ms(m.self_us) for m in modules.values())
    print(f"{len(modules)} modules imported, {total:.0f} ms of import time in all (sum of median self times)")

    def owner(m: Imported) -> str:
        """The nearest dtypeaudit module that imported m (m itself if it is one); a module imported at top
        level outside dtypeaudit is its own owner (the interpreter's start-up, or a lazy import at run time)."""
        cur: Imported | None = m
        while cur is not None:
            if cur.name.split(".")[0] == "dtypeaudit":
                return cur.name
            if cur.parent is None:
                return f"({cur.name.split('.')[0]})"
            cur = modules[cur.parent]
        return "?"

    owned: dict[str, float] = {}
    pulled: dict[str, dict[str, float]] = {}
    for m in modules.values():
        o = owner(m)
        owned[o] = owned.get(o, 0.0) + _ms(m.self_us)
        if m.name != o:
            pkg = m.name.split(".")[0]
            pulled.setdefault(o, {})[pkg] = pulled.setdefault(o, {}).get(pkg, 0.0) + _ms(m.self_us)
    print(f"\nby owner: each module's self time charged to the nearest dtypeaudit module above it (top {top})")
    print(f"{'owner':40}{'ms':>7}  what it pulls in (ms)")
    for o, ms in sorted(owned.items(), key=lambda kv: -kv[1])[:top]:
        parts = sorted(pulled.get(o, {}).items(), key=lambda kv: -kv[1])[:6]
        print(f"{o:40}{ms:7.1f}  " + ", ".join(f"{p} {v:.1f}" for p, v in parts))
    print(f"\nby cumulative time (top {top}): a module and everything it imported first")
    print(f"{'module':44}{'cumul ms':>9}{'self ms':>9}  imported by")
    for m in sorted(modules.values(), key=lambda m: -_ms(m.cumulative_us))[:top]:
        print(f"{m.name:44}{_ms(m.cumulative_us):9.1f}{_ms(m.self_us):9.1f}  {m.parent or '-'}")


# -- main ---------------------------------------------------------------------------------------------------


def dtypeaudit_commands(venv: Path, small: Path, suffix: str = "") -> dict[str, list[str]]:
    exe = str(venv / "bin" / "dtypeaudit")
    commands = {
        f"dtypeaudit --version{suffix}": [exe, "--version"],
        f"dtypeaudit scan small.pt -f plain{suffix}": [exe, "scan", str(small), "-f", "plain"],
        f"dtypeaudit scan small.pt -f json{suffix}": [exe, "scan", str(small), "-f", "json"],
    }
    scan_help = subprocess.run([exe, "scan", "--help"], capture_output=True, text=True, env=_clean_env(), cwd=STARTUP).stdout
    if "--quiet" in scan_help:
        commands[f"dtypeaudit scan small.pt --quiet{suffix}"] = [exe, "scan", str(small), "--quiet"]
    return commands


# --split: the scan's start-up built up a piece at a time, each a whole process in the same venv
STDLIB_OF_A_SCAN = "import re, enum, typing, pathlib, dataclasses, json, struct, pickle, contextvars, threading, mmap, glob, fnmatch"
SPLIT = {
    "the standard library a scan uses": ["-c", STDLIB_OF_A_SCAN],
    "import typer": ["-c", "import typer"],
    "import dtypeaudit.cli (Typer included)": ["-c", "import dtypeaudit.cli"],
    "+ build the scan command": [
        "-c",
        "import dtypeaudit.cli as c, typer.main; c.only_the_invoked_command(['scan']); typer.main.get_command(c.app)",
    ],
    "import dtypeaudit.pipeline, dtypeaudit.render.text": ["-c", "import dtypeaudit.pipeline, dtypeaudit.render.text"],
}

NO_CLI_SCAN = (
    "import sys; from dtypeaudit.pipeline import scan; from dtypeaudit.render import OutputFormat, renderer_for; "
    "sys.stdout.write(renderer_for(OutputFormat.plain)(scan(sys.argv[1:], jobs=1)))"
)


FULL_INSTALL_SCAN = (
    f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['dtypeaudit', 'scan', sys.argv[1], '-f', 'plain']; "
    "from dtypeaudit.entry import main; main()"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--imports", type=int, default=0, metavar="N", help="also profile a scan's imports over N runs")
    parser.add_argument("--top", type=int, default=30, help="rows of each import table")
    parser.add_argument("--split", action="store_true", help="also the scan's start-up built up a piece at a time")
    parser.add_argument("--also", type=Path, action="append", default=[], metavar="SRC", help="another source tree, measured alongside")
    args = parser.parse_args()

    venv = make_venv(ROOT, "venv")
    others = [(src.resolve(), make_venv(src.resolve(), f"venv-{src.resolve().name}")) for src in args.also]
    small = make_small_checkpoint(STARTUP / "small.pt")
    hf = make_small_hf_folder(STARTUP / "tiny-gpt2")
    env = _clean_env()
    py = str(venv / "bin" / "python")
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "picklescan -p small.pt": [str(venv / "bin" / "picklescan"), "-p", str(small)],
        "python -c 'import typer'": [py, "-c", "import typer"],  # the part of the budget the CLI framework alone takes
        # the same scan and plain report without the command line (no Typer): what the CLI framework costs a scan
        "scan small.pt -f plain, no CLI": [py, "-c", NO_CLI_SCAN, str(small)],
        **dtypeaudit_commands(venv, small),
        # a Hugging Face folder: read through data/transformers.json, in the light install and in this interpreter's
        # (torch and transformers installed, this source tree first on the path): the same imports, the same time
        "dtypeaudit scan tiny-gpt2/ -f plain": [str(venv / "bin" / "dtypeaudit"), "scan", str(hf), "-f", "plain"],
        "scan small.pt, full install": [sys.executable, "-c", FULL_INSTALL_SCAN, str(small)],
        "scan tiny-gpt2/, full install": [sys.executable, "-c", FULL_INSTALL_SCAN, str(hf)],
    }
    if args.split:
        commands.update({label: [py, *argv] for label, argv in SPLIT.items()})
    for src, other in others:
        commands.update(dtypeaudit_commands(other, small, f" [{src.name}]"))
    check_runs(commands, env)
    measure_rounds(commands, env, 1)  # warm-up: page cache, bytecode, nothing counted

    before = os.getloadavg()
    start = time.perf_counter()
    runs, loads = measure_rounds(commands, env, args.repeat)
    after = os.getloadavg()
    print(
        f"{small.name} ({small.stat().st_size} B), regular install in {venv}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, {args.repeat} rounds in {time.perf_counter() - start:.0f} s"
    )
    print(
        f"load average (1, 5, 15 min): before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, after {after[0]:.2f} "
        f"{after[1]:.2f} {after[2]:.2f}; 1-min over the rounds {min(loads):.2f} to {max(loads):.2f}"
    )
    print_table(runs, "picklescan -p small.pt", "python -c pass")
    pairs = list(zip(runs["dtypeaudit scan small.pt -f plain"], runs["picklescan -p small.pt"], strict=True))
    wall = statistics.median(r.wall_s / p.wall_s for r, p in pairs)
    cpu = statistics.median(r.cpu_s / p.cpu_s for r, p in pairs)
    met = "met" if wall <= 1.5 and cpu <= 1.5 else "NOT met"
    print(f"target: scan -f plain <= 1.50x picklescan's wall and CPU time: {wall:.2f}x wall, {cpu:.2f}x CPU, {met}")
    for folder, file in (
        ("dtypeaudit scan tiny-gpt2/ -f plain", "dtypeaudit scan small.pt -f plain"),
        ("scan tiny-gpt2/, full install", "scan small.pt, full install"),
    ):
        pairs = list(zip(runs[folder], runs[file], strict=True))
        wall = statistics.median(r.wall_s / p.wall_s for r, p in pairs)
        cpu = statistics.median(r.cpu_s / p.cpu_s for r, p in pairs)
        met = "met" if wall <= 1.5 and cpu <= 1.5 else "NOT met"
        print(f"target (issue 29): {folder} <= 1.50x {file}: {wall:.2f}x wall, {cpu:.2f}x CPU, {met}")

    if args.imports:
        exe = str(venv / "bin" / "dtypeaudit")
        print(f"\nimports of `dtypeaudit scan small.pt -f plain`, median of {args.imports} runs of python -X importtime")
        print_imports(import_profile([py, "-X", "importtime", exe, "scan", str(small), "-f", "plain"], env, args.imports), args.top)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
