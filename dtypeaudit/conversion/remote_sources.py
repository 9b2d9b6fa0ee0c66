"""Remote conversion: one file at a time through a local temporary, published last.

Each remote file (a single checkpoint, or each weight file a Hugging Face directory's resolution lists) is
downloaded to a local temporary directory and converted there by the local code path (plan checks, value
checks, and verification: ``verify.verify_written`` reads the written file back once, names, dtypes, shapes,
ties and every record's CRC, before it is uploaded). A remote output is then uploaded to a temporary name under
the destination (s3fs uploads a big file in parts) and the upload checked without a second transfer: its size
is the verified file's, and its header, read through the remote reader, holds what the writer's ``Written``
says. The local copies are removed before the next file: local disk and memory are bounded by the largest file.
Only when every file is in place are the temporary names moved to their own, and a directory's config.json
and index written last, so a reader never sees a half-converted model under the destination's names. A local
output directory is made inside ``atomic_output``'s temporary and swapped into place, as a local source's is.

What is refused is refused from the remote headers (``refusals``) before a byte is downloaded.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ConversionError, UsageError
from ..formats import Format, read_checkpoint
from ..formats import directory as hfdir
from ..formats.locate import TargetRef, parse_target
from ..formats.remote import RemotePath, filesystem, remote_call, remote_fs
from ..inventory import Inventory
from ..options import ConvertSettings
from ..pipeline import model_inventory, prepare
from ..redact import redact
from .atomic import atomic_output
from .modeldir import config_with_dtype, index_with_sizes, output_index, read_json, write_json
from .plan import Plan, make_plan, with_findings
from .result import Result, refusals
from .verify import Written

Local = Callable[..., Any]
"""The local ``convert`` (passed in, so that this module does not import its package), or it with the settings."""


def _shape_map(inv: Inventory, file: str | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, tuple(t.shape)) for t in inv.tensors if file is None or t.file == file}


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

    def uploaded(self, local: Path, path: str, written: Written | None, shown: str) -> None:
        """Check the upload of ``local`` (verified before it was uploaded) at ``path``, without a second transfer of
        the weights: the same size, and, for a weight file, a header that holds what its writer's ``written`` says
        (each name, dtype and shape, as ``verify_written`` compares them; a tie kept as an alias is under its
        target's name); a small file beside them (config.json, the index) is read back whole and compared."""
        size, made = remote_call(lambda: self.fs.size(path), shown), local.stat().st_size
        if size != made:
            why = f"the upload is {size} bytes, the verified file {made}"
            raise ConversionError(f"verification failed: {why}; nothing was published", path=shown)
        if written is None:  # config.json, the index, a file copied as it is
            if made <= SMALL_UPLOAD_BYTES and remote_call(lambda: self.fs.cat_file(path), shown) != local.read_bytes():
                raise ConversionError(
                    "verification failed: the upload's bytes differ from the file written; nothing was published", path=shown
                )
            return
        have = _shape_map(self.reread(path))
        want = {written.aliases.get(n, n): (dtype, tuple(shape)) for n, (dtype, shape) in written.tensors.items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise ConversionError(
                f"verification failed: the upload does not hold what was written ({len(diff)} difference(s), first: {diff[0][0]}); "
                "nothing was published",
                path=shown,
            )


SMALL_UPLOAD_BYTES = 1 << 20
"""A file beside the weights up to this size is read back whole after its upload (config.json, the index, a tokenizer's
files); a larger one, like the weights, is checked by its size."""


def _download(src: RemotePath, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    remote_call(lambda: src.rfs.fs.get_file(src.path, str(local)), str(src))


def _shown_plan(result: Result, shown: str) -> Result:
    result.plan = replace(result.plan, source=replace(result.plan.source, path=shown))
    return result


def convert_remote(
    source: TargetRef,
    settings: ConvertSettings,
    local_convert: Local,
    *,
    output: str | Path | None,
    progress_factory: Callable[[str, int], Any] | None,
) -> Result:
    """``convert`` for a URL source (see the module's docstring); the Result names the source and output as given."""
    s = settings
    shown = redact(source.text)
    if s.in_place:
        raise UsageError(f"{shown}: --in-place cannot replace a remote checkpoint; give -o")
    if output is None and not s.dry_run:
        raise UsageError(f"{shown}: a remote checkpoint needs -o (a local path or a URL) for the converted output")
    if s.max_shard_size:
        raise UsageError("--max-shard-size re-shards local directories only")
    # Located once (a hub id: the cache, else the hub), then read where it lies: headers only, so that what is
    # refused is refused before a byte is downloaded.
    root, found = source.located()
    origin = (found.source, found.revision) if found is not None else source.hub_origin
    inv = read_checkpoint(TargetRef(source.text, source.kind, root, origin))
    refused = refusals(inv)
    if refused:
        return Result(Plan(inv, s.to, []), None, [], dry_run=s.dry_run, refused=refused)
    local = partial(local_convert, settings=s, progress_factory=progress_factory)
    if isinstance(root, Path):  # a hub id found in the local cache: a local conversion
        return local(root, output=output)
    dest = _Dest(output) if output is not None else None
    if dest is not None and not s.dry_run:
        dest.check(s.force)
    if inv.format == Format.HF_DIRECTORY:
        from ..quant.group import view as quant_view

        if quant_view(inv) and not s.keep_quantized:
            # a weight's storage may lie in several files (its scales in another shard): dequantized as one folder
            return _whole(root, local, dest, shown, s.dry_run)
        return _directory(root, inv, s, local, dest)
    with tempfile.TemporaryDirectory(prefix="dtypeaudit-remote-") as td:
        local_src = Path(td) / "in" / (root.name or "checkpoint")
        _download(root, local_src)
        if dest is None or not dest.remote:
            out = local(local_src, output=dest.local if dest else None)
            if out.output is not None:
                out.output = dest.shown if dest else None
            return _shown_plan(out, shown)
        local_out = Path(td) / "out" / posixpath.basename(dest.path)
        local_out.parent.mkdir()
        result = local(local_src, output=local_out)  # verified there, before the upload
        local_src.unlink()
        _shown_plan(result, shown)
        if result.output is None:
            return result
        tmp = f"{posixpath.dirname(dest.path)}/.{posixpath.basename(dest.path)}{dest.tag}"
        try:
            dest.put(local_out, tmp)
            dest.uploaded(local_out, tmp, result.written[local_out.name], dest.shown)
            local_out.unlink()
            dest.move(tmp, dest.path)
        except BaseException:
            dest.remove([tmp])
            raise
        result.output = dest.shown
        return result


def _directory(root: RemotePath, inv: Inventory, s: ConvertSettings, local: Local, dest: _Dest | None) -> Result:
    """The directory planned once, from its remote headers; each weight file then downloaded and converted alone
    by the local path as that plan says (its part of it: ``_part``), and published together."""
    res = hfdir.resolve(root)
    if res is None:
        raise ConversionError("directory holds no weights to convert", path=str(root))
    full = prepare(inv, model_inventory(s.model))
    plan_options: dict[str, Any] = {
        "keep": s.keep,
        "include_optimizer": s.include_optimizer,
        "strip_optimizer": s.strip_optimizer,
        "clamp": s.clamp,
    }
    if s.keep_quantized:
        from ..quant.group import view as quant_view

        plan_options["quantized"] = quant_view(inv).consumed
    plan = with_findings(make_plan(full, s.to, policy=s.policy, **plan_options), s.policy, strict=s.strict)
    if plan.failing(s.policy):
        return Result(plan, None, [], dry_run=s.dry_run, failed=tuple(plan.failing(s.policy)))
    if s.dry_run and not s.read_values:  # metadata only: the remote headers said it all
        return Result(plan, None, [], dry_run=True, values_read=False)
    unsafe: list[Any] = []
    values: dict[str, Any] = {}
    total = 0
    written: dict[str, Written] = {}
    with tempfile.TemporaryDirectory(prefix="dtypeaudit-remote-") as td, _staging(dest, s.dry_run, Path(td) / "out") as stage:
        for label in res.files:
            local_src = Path(td) / "in" / label
            _download(root / label, local_src)
            r = local(local_src, output=stage.place(label), planned=_part(plan, label))
            local_src.unlink()
            if r.refused or r.failed:
                return Result(plan, None, [], dry_run=s.dry_run, refused=r.refused, failed=r.failed)
            unsafe.extend(r.unsafe)
            values.update(r.plan.values)
            if s.dry_run or r.unsafe:
                continue
            # the local convert verified the file against what it wrote (verify_written), before stage.put uploads it
            total += r.plan.bytes_after
            (written[label],) = r.written.values()
            stage.put(label, written[label])
        plan = replace(plan, values=values)
        if unsafe or s.dry_run:
            return Result(plan, None, unsafe, dry_run=s.dry_run)
        # every other file: config.json with the planned dtype and the output's index (modeldir decides which, as
        # for a local directory) rewritten, the rest copied; published last, the index after config.json
        index = output_index(inv)
        extras = _other_files(root, set(res.files))
        for name in extras:
            local_file = stage.place(name)
            _download(root / name, local_file)
            if name == "config.json":
                write_json(local_file, config_with_dtype(read_json(local_file), plan.config_dtype))
            if name == index:
                write_json(local_file, index_with_sizes(read_json(local_file), total))
            stage.put(name, None)
        stage.publish(list(written), sorted(extras, key=lambda n: (n == index, n == "config.json", n)))
    return Result(plan, dest.shown if dest else None, [], written=written)


def _part(plan: Plan, label: str) -> Plan:
    """The part of a directory's plan that one of its weight files takes, its tensors relabelled as a lone file's
    (a directory's units are its files' own: a unit never spans two files)."""
    tensors = [replace(p, tensor=p.tensor.with_(file="")) for p in plan.tensors if p.tensor.file == label]
    return replace(plan, tensors=tensors, notes=[], values={}, findings=[])


def _whole(root: RemotePath, local: Local, dest: _Dest | None, shown: str, dry_run: bool) -> Result:
    """A folder converted as one: downloaded whole to a local temporary, converted there by the local path (one
    plan, the one a local copy gets: a quantized folder is dequantized, its values checked), its output published
    as a directory's is (weights, then the other files, config.json and the index last). Local disk holds the
    folder and its output, not one file."""
    import shutil

    res = hfdir.resolve(root)
    if res is None:
        raise ConversionError("directory holds no weights to convert", path=str(root))
    with tempfile.TemporaryDirectory(prefix="dtypeaudit-remote-") as td, _staging(dest, dry_run, Path(td) / "out") as stage:
        local_src = Path(td) / "in" / "model"
        for name in [*res.files, *_other_files(root, set(res.files))]:
            _download(root / name, _made(local_src / name))
        made = Path(td) / "made"
        result = local(local_src, output=None if dry_run else made)
        _shown_plan(result, shown)
        if result.output is None:
            return result
        names = sorted(str(p.relative_to(made)) for p in made.rglob("*") if p.is_file())
        shards = [n for n in names if n in result.written]
        index = output_index(result.plan.source)
        extras = sorted((n for n in names if n not in result.written), key=lambda n: (n == index, n == "config.json", n))
        for name in [*shards, *extras]:
            shutil.move(made / name, stage.place(name))  # the output may lie on another filesystem
            stage.put(name, result.written.get(name))
        stage.publish(shards, extras)
    result.output = dest.shown if dest else None
    return result


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


class _Scratch:
    """Where a dry run's files would go (a dry run writes none)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def place(self, name: str) -> Path:
        return _made(self.scratch / name)

    def put(self, name: str, written: Written | None) -> None:  # pragma: no cover - a dry run writes nothing
        raise AssertionError("a dry run writes nothing")

    def publish(self, shards: list[str], extras: list[str]) -> None:  # pragma: no cover
        raise AssertionError("a dry run writes nothing")


class _LocalStage:
    """A local output directory, made in ``atomic_output``'s temporary beside it: each file is made in place
    (``place``), and leaving ``_staging`` after ``publish`` fsyncs it and swaps it in, the one swap every
    conversion ends with; without ``publish`` it is removed."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.published = False

    def place(self, name: str) -> Path:
        return _made(self.tmp / name)

    def put(self, name: str, written: Written | None) -> None:
        """Nothing to move: the file was made where it stays (and a weight file verified there)."""

    def publish(self, shards: list[str], extras: list[str]) -> None:
        self.published = True


class _RemoteStage:
    """A remote output directory as it is made: files made locally in ``scratch``, each uploaded under a hidden
    temporary prefix of ``dest`` and checked there, moved to their own names by ``publish``."""

    def __init__(self, dest: _Dest, scratch: Path) -> None:
        self.dest = dest
        self.scratch = scratch
        self.tmp = f"{dest.path}/{dest.tag}"
        self.before = self._listing() if dest.exists() else []

    def _listing(self) -> list[str]:
        fs = self.dest.fs
        return [posixpath.relpath(p, self.dest.path) for p in remote_call(lambda: fs.find(self.dest.path), self.dest.shown)]

    def place(self, name: str) -> Path:
        return _made(self.scratch / name)

    def put(self, name: str, written: Written | None) -> None:
        local = self.scratch / name
        self.dest.put(local, f"{self.tmp}/{name}")
        self.dest.uploaded(local, f"{self.tmp}/{name}", written, redact(self.dest.url(f"{self.dest.path}/{name}")))
        local.unlink()

    def publish(self, shards: list[str], extras: list[str]) -> None:
        """Weight files first, then the other files, config.json and the index last."""
        for name in [*shards, *extras]:
            self.dest.move(f"{self.tmp}/{name}", f"{self.dest.path}/{name}")
        stale = [f"{self.dest.path}/{n}" for n in self.before if n not in set(shards) | set(extras) and not n.startswith(self.dest.tag)]
        self.dest.remove(stale)

    def cleanup(self) -> None:
        """Whatever is left of the temporary prefix: all of it when the conversion stopped early."""
        try:
            found = self.dest.fs.find(self.tmp)
        except (FileNotFoundError, OSError):
            found = []
        self.dest.remove(list(found))
        remote_fs(self.dest.fs).forget()


def _made(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _Unpublished(Exception):
    """Thrown into ``atomic_output`` when the conversion stopped before ``publish``: its temporary is removed."""


@contextmanager
def _staging(dest: _Dest | None, dry_run: bool, scratch: Path) -> Iterator[_Scratch | _LocalStage | _RemoteStage]:
    if dest is None or dry_run:
        yield _Scratch(scratch)
    elif dest.remote:
        stage = _RemoteStage(dest, scratch)
        try:
            yield stage
        finally:
            stage.cleanup()
    else:
        try:
            with atomic_output(dest.local, mode_from=None, is_dir=True) as tmp:
                local = _LocalStage(tmp)
                yield local
                if not local.published:
                    raise _Unpublished
        except _Unpublished:
            pass
