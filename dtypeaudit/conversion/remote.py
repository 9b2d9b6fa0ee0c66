"""Remote conversion: one file at a time through a local temporary, published last.

Each remote file (a single checkpoint, or each weight file a Hugging Face directory's resolution lists) is
downloaded to a local temporary directory, converted there by the local code path (refusals, plan checks,
value checks, verification, all as for a local file), uploaded to a temporary name under the destination
(s3fs uploads a big file in parts), re-read through the remote reader and compared with the plan, and the
local copies removed before the next file: local disk and memory are bounded by the largest file.
Only when every file is in place are the temporary names moved to their own, and a directory's config.json
and index written last, so a reader never sees a half-converted model under the destination's names.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import ConversionError, UsageError
from ..formats import Format, read_checkpoint
from ..formats import directory as hfdir
from ..formats.locate import TargetRef, parse_target
from ..formats.remote import RemotePath, filesystem, remote_call, remote_fs
from ..inventory import Inventory
from ..pipeline import model_inventory, prepare
from ..policy import Policy
from ..redact import redact
from .atomic import swap_into_place
from .modeldir import config_with_dtype, index_with_sizes, read_json, write_json
from .plan import Plan, make_plan
from .result import Result, plan_fails, refusals

Local = Callable[..., Any]
"""The local ``convert`` (passed in, so that this module does not import its package)."""


def _shape_map(inv: Inventory, file: str | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, tuple(t.shape)) for t in inv.tensors if file is None or t.file == file}


def _compare(got: Inventory, want: dict[str, tuple[str, tuple[int, ...]]], shown: str) -> None:
    have = _shape_map(got)
    if have != want:
        diff = sorted(set(have.items()) ^ set(want.items()))
        name = diff[0][0] if diff else "?"
        raise ConversionError(
            f"the uploaded file does not hold what the plan says ({len(diff)} difference(s), first: {name}); nothing was published",
            path=shown,
        )


def _agrees(alone: dict[str, tuple[str, tuple[int, ...]]], whole: dict[str, tuple[str, tuple[int, ...]]], plan: Plan, shown: str) -> None:
    """A file converted alone must come out as the directory's plan says (but for what --keep-unsafe held)."""
    held = {p.tensor.name for p in plan.tensors if p.reason.endswith("(--keep-unsafe)")}
    if alone.keys() != whole.keys() or any(alone[k] != whole[k] for k in alone if k not in held):
        raise ConversionError(
            "converted on its own, this file would not come out as the directory's plan says (a unit or tie across files?); "
            "nothing was published: convert a local copy of the directory",
            path=shown,
        )


class _Dest:
    """Where the output goes: a local path or a URL, with a temporary area that readers do not take for the model."""

    def __init__(self, output: str | Path) -> None:
        self.shown = redact(str(output))
        named = parse_target(output, models=False) if isinstance(output, str) else None
        self.remote = named is not None and named.is_remote
        if named is not None and self.remote:
            self.fs, self.path = filesystem(named.text)
            self.path = self.path.rstrip("/") or self.path
        else:
            where = named.where if named is not None else output
            assert isinstance(where, Path)
            self.local = where
            self.path = str(self.local)
        self.tag = f".dtypeaudit-{os.getpid()}.tmp"

    def exists(self) -> bool:
        if self.remote:
            return bool(remote_call(lambda: self.fs.exists(self.path), self.shown))
        return self.local.exists() or self.local.is_symlink()

    def check(self, force: bool) -> None:
        if self.exists() and not force:
            raise ConversionError("output already exists; pass --force to replace it", path=self.shown)
        if not self.remote and not self.local.parent.is_dir():
            raise ConversionError("output directory does not exist", path=str(self.local.parent))

    def url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def put(self, local: Path, path: str) -> None:
        remote_call(lambda: self.fs.put_file(str(local), path), redact(self.url(path)))

    def move(self, src: str, dst: str) -> None:
        remote_call(lambda: self.fs.mv(src, dst), redact(self.url(dst)))

    def remove(self, paths: list[str]) -> None:
        for p in paths:
            try:
                self.fs.rm(p)
            except (FileNotFoundError, OSError):
                pass

    def reread(self, path: str) -> Inventory:
        """The inventory of ``path`` (a URL's path on this filesystem) through the remote reader, nothing cached."""
        rfs = remote_fs(self.fs)
        rfs.forget()
        return read_checkpoint(RemotePath(rfs, path))  # where it was written: not a URL to locate again


def _download(src: RemotePath, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    remote_call(lambda: src.rfs.fs.get_file(src.path, str(local)), str(src))


def _shown_plan(result: Result, shown: str) -> Result:
    plan = result.plan
    plan.source = replace(plan.source, path=shown)
    return result


def convert_remote(
    source: TargetRef,
    to: str,
    local_convert: Local,
    *,
    output: str | Path | None,
    policy: Policy | None,
    force: bool,
    dry_run: bool,
    in_place: bool,
    max_shard_size: str | None,
    model: str | None,
    options: dict[str, Any],
) -> Result:
    """``convert`` for a URL source (see the module's docstring); the Result names the source and output as given."""

    shown = redact(source.text)
    if in_place:
        raise UsageError(f"{shown}: --in-place cannot replace a remote checkpoint; give -o")
    if output is None and not dry_run:
        raise UsageError(f"{shown}: a remote checkpoint needs -o (a local path or a URL) for the converted output")
    if max_shard_size:
        raise UsageError("--max-shard-size re-shards local directories only")
    # Located once (a hub id: the cache, else the hub), then read where it lies: headers only, so that what is
    # refused is refused before a byte is downloaded.
    root, found = source.located()
    origin = (found.source, found.revision) if found is not None else source.hub_origin
    inv = read_checkpoint(TargetRef(source.text, source.kind, root, origin))
    refused = refusals(inv)
    if refused:
        return Result(Plan(inv, dtypes.conversion_target(to), []), None, [], dry_run=dry_run, refused=refused)
    if isinstance(root, Path):  # a hub id found in the local cache: a local conversion
        return local_convert(root, to, output=output, policy=policy, force=force, dry_run=dry_run, model=model, **options)
    dest = _Dest(output) if output is not None else None
    if dest is not None and not dry_run:
        dest.check(force)
    if inv.format == Format.HF_DIRECTORY:
        return _directory(root, inv, to, local_convert, dest, policy=policy, dry_run=dry_run, model=model, options=options)
    with tempfile.TemporaryDirectory(prefix="dtypeaudit-remote-") as td:
        local_src = Path(td) / "in" / (root.name or "checkpoint")
        _download(root, local_src)
        kw: dict[str, Any] = {"policy": policy, "dry_run": dry_run, "model": model, **options}
        if dest is None or not dest.remote:
            out = local_convert(local_src, to, output=dest.local if dest else None, force=force, **kw)
            if out.output is not None:
                out.output = dest.shown if dest else None
            return _shown_plan(out, shown)
        local_out = Path(td) / "out" / posixpath.basename(dest.path)
        local_out.parent.mkdir()
        result = local_convert(local_src, to, output=local_out, **kw)
        local_src.unlink()
        _shown_plan(result, shown)
        if result.output is None:
            return result
        tmp = f"{posixpath.dirname(dest.path)}/.{posixpath.basename(dest.path)}{dest.tag}"
        try:
            dest.put(local_out, tmp)
            local_out.unlink()
            _compare(dest.reread(tmp), _shape_map(result.plan.output_inventory()), dest.shown)
            dest.move(tmp, dest.path)
        except BaseException:
            dest.remove([tmp])
            raise
        result.output = dest.shown
        return result


def _directory(
    root: RemotePath,
    inv: Inventory,
    to: str,
    local_convert: Local,
    dest: _Dest | None,
    *,
    policy: Policy | None,
    dry_run: bool,
    model: str | None,
    options: dict[str, Any],
) -> Result:
    """Each weight file converted alone, checked against the whole directory's plan, then published together."""
    res = hfdir.resolve(root)
    if res is None:
        raise ConversionError("directory holds no weights to convert", path=str(root))
    full = prepare(inv, model_inventory(model))
    plan_options = {k: options[k] for k in ("keep", "include_optimizer", "strip_optimizer", "clamp")}
    plan = make_plan(full, to, policy=policy, **plan_options)
    if plan_fails(plan, policy):
        return Result(plan, None, [], dry_run=dry_run, failed=tuple(plan.failing(policy)))
    if dry_run and not options.get("read_values", True):  # metadata only: the remote headers said it all
        return Result(plan, None, [], dry_run=True, values_read=False)
    expected = plan.output_inventory()
    unsafe: list[Any] = []
    total = 0
    written: list[str] = []  # names relative to the output directory, in its temporary area
    with _staging(dest, dry_run) as stage:
        with tempfile.TemporaryDirectory(prefix="dtypeaudit-remote-") as td:
            for label in res.files:
                local_src = Path(td) / "in" / label
                _download(root / label, local_src)
                local_out = Path(td) / "out" / label
                local_out.parent.mkdir(parents=True, exist_ok=True)
                r = local_convert(local_src, to, output=local_out, policy=policy, dry_run=dry_run, model=model, **options)
                local_src.unlink()
                if r.refused or r.failed:
                    return Result(plan, None, [], dry_run=dry_run, refused=r.refused, failed=r.failed)
                unsafe.extend(r.unsafe)
                plan.values.update(r.plan.values)
                if dry_run or r.unsafe:
                    continue
                want = _shape_map(r.plan.output_inventory())
                # the local convert verified local_out against r.plan with one read; an upload is read back in stage.put
                _agrees(want, _shape_map(expected, label), r.plan, f"{root}/{label}")
                total += r.plan.bytes_after
                stage.put(local_out, label, want)
                local_out.unlink(missing_ok=True)
                written.append(label)
            if unsafe or dry_run:
                return Result(plan, None, unsafe, dry_run=dry_run)
            # every other file: config.json with the planned dtype, the index last, the rest copied
            extras = _other_files(root, set(res.files))
            for name in extras:
                local = Path(td) / "extra" / name
                _download(root / name, local)
                if name == "config.json" and plan.config_dtype is not None:
                    write_json(local, config_with_dtype(read_json(local), plan.config_dtype))
                if name in hfdir.INDEX_NAMES:
                    write_json(local, index_with_sizes(read_json(local), total))
                stage.put(local, name, None)
                local.unlink(missing_ok=True)
            stage.publish(written, sorted(extras, key=lambda n: (n in hfdir.INDEX_NAMES, n == "config.json", n)))
    return Result(plan, dest.shown if dest else None, [])


def _other_files(root: RemotePath, shards: set[str]) -> list[str]:
    """Every file under ``root`` that is not a weight file (nor hidden), relative to it."""
    fs = root.rfs.fs
    found = remote_call(lambda: fs.find(root.path), str(root))
    out = []
    for p in found:
        name = posixpath.relpath(p, root.path)
        if name in shards or any(part.startswith(".") for part in name.split("/")):
            continue
        out.append(name)
    return out


class _Stage:
    """A directory's output as it is made: a hidden temporary directory (local) or prefix (remote) under ``dest``."""

    def __init__(self, dest: _Dest) -> None:
        self.dest = dest
        if dest.remote:
            self.tmp = f"{dest.path}/{dest.tag}"
            self.before = self._listing() if dest.exists() else []
        else:
            self.local_tmp = dest.local.parent / f".{dest.local.name}{dest.tag}"
            self.local_tmp.mkdir()

    def _listing(self) -> list[str]:
        fs = self.dest.fs
        return [posixpath.relpath(p, self.dest.path) for p in remote_call(lambda: fs.find(self.dest.path), self.dest.shown)]

    def put(self, local: Path, name: str, want: dict[str, tuple[str, tuple[int, ...]]] | None) -> None:
        if self.dest.remote:
            self.dest.put(local, f"{self.tmp}/{name}")
            if want is not None:
                _compare(self.dest.reread(f"{self.tmp}/{name}"), want, redact(self.dest.url(f"{self.dest.path}/{name}")))
        else:
            target = self.local_tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(local), target)

    def publish(self, shards: list[str], extras: list[str]) -> None:
        """Weight files first, then the other files, config.json and the index last."""
        if not self.dest.remote:
            swap_into_place(self.local_tmp, self.dest.local)
            return
        for name in [*shards, *extras]:
            self.dest.move(f"{self.tmp}/{name}", f"{self.dest.path}/{name}")
        stale = [f"{self.dest.path}/{n}" for n in self.before if n not in set(shards) | set(extras) and not n.startswith(self.dest.tag)]
        self.dest.remove(stale)

    def abandon(self) -> None:
        if self.dest.remote:
            try:
                found = self.dest.fs.find(self.tmp)
            except (FileNotFoundError, OSError):
                found = []
            self.dest.remove(list(found))
        else:
            shutil.rmtree(self.local_tmp, ignore_errors=True)

    def cleanup(self) -> None:
        if self.dest.remote:
            self.abandon()
            remote_fs(self.dest.fs).forget()
        elif self.local_tmp.exists():
            shutil.rmtree(self.local_tmp, ignore_errors=True)


class _NoStage:
    def put(self, local: Path, name: str, want: Any) -> None:  # pragma: no cover - a dry run writes nothing
        raise AssertionError("a dry run writes nothing")

    def publish(self, shards: list[str], extras: list[str]) -> None:  # pragma: no cover
        raise AssertionError("a dry run writes nothing")


@contextmanager
def _staging(dest: _Dest | None, dry_run: bool) -> Iterator[Any]:
    if dest is None or dry_run:
        yield _NoStage()
        return
    stage = _Stage(dest)
    try:
        yield stage
    finally:
        stage.cleanup()  # whatever is left of the temporary area: all of it when the conversion stopped early
