"""The code cache: the frozen base as the sliced loader stores it, kept on local disk so that the next fit, resume or
``load_from_checkpoint`` of the same base maps it instead of reading and encoding the folder again.

One file per base, ``frozen_dtype`` and layout (``zero/frozen_files.py`` lays it out and maps it): every rank's
shards, as the ranks of one machine share them, then an index with what the loader recorded of each slice (the
checksums the fingerprint reads, a CRC of each row). It is named by what determines its bytes: the folder's files
(paths, sizes, modification times, safetensors headers), ``frozen_dtype``, the fingerprint mode, the layout and the
package's version. It is written whole or not at all (renamed into place once its index is written), by one fit at a
time (a lock per name), mapped only where this user alone could have written it, and evicted least recently used
beyond its size limit. Where it cannot be used, one line says why and the fit loads as it did (docs/frozen-storage.md,
"The code cache").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_frozen import process
from lightning_frozen.base import slice_reads
from lightning_frozen.base.loaded import LoadedBase
from lightning_frozen.format.codec import block_format
from lightning_frozen.zero import collectives, frozen_files
from lightning_frozen.zero.frozen_storage import frozen_dtype_of
from lightning_frozen.zero.params import full_numel, shard_numel

ENVIRONMENT = process.CODE_CACHE  # where the cache lives, when the strategy's argument does not say
LIMIT_ENVIRONMENT = "LIGHTNING_FROZEN_CODE_CACHE_GB"  # its size limit, in GiB
DEFAULT_LIMIT_GB = 256
FREE_MARGIN = 1 << 30  # bytes a new file leaves free on the disk, at least
_FORMAT = 1  # of the files; with the package's version in every name
_SUFFIX = ".codes"
_PARTIAL = process.owned_names("partial", _SUFFIX)


@dataclass(frozen=True)
class Part:
    """One tensor the loader fills: ``target`` (a ZeRO-3 param, of which each rank keeps its shard, or a whole
    tensor), whose values lie in ``files``, stored as ``frozen_dtype`` codes (floating-point shards) or as values."""

    name: str
    target: torch.Tensor
    sliced: bool
    files: tuple[str, ...]
    frozen_dtype: Optional[str]

    def row_bytes(self) -> int:
        if not self.sliced:
            return full_numel(self.target) * self.target.element_size()
        if self.frozen_dtype is not None:
            return block_format(self.frozen_dtype).stored_bytes(shard_numel(self.target))
        return shard_numel(self.target) * self.target.element_size()


@dataclass
class CachedLoad:
    """One load's use of the cache, on every rank: a file mapped whole (``hit``), or one being written as the loader
    stores each part (:meth:`keep`, then :meth:`finish`)."""

    parts: list[Part]
    mapped: frozen_files.MappedFile
    path: Path  # the file's name once whole
    hit: bool
    rank: int
    rows: int
    group: Any
    index: dict = field(default_factory=dict)
    _offsets: dict[str, int] = field(default_factory=dict)
    _lock: Optional[IO[bytes]] = None
    _started: float = field(default_factory=time.monotonic)

    def place_all(self, loaded: LoadedBase, sources: dict[str, slice_reads.TensorSource]) -> None:
        """Every part from the mapped file, as the loader would have stored it, with what it recorded then."""
        for part in self.parts:
            offset, rows, row_bytes, _, entries, frozen_dtype = self.index["parts"][part.name]
            if part.sliced:
                frozen_files.place(part.target, self.mapped, offset, rows, row_bytes, self.rank, frozen_dtype)
                loaded.restore(part.target, entries[self.rank], sources[part.name] if frozen_dtype else None)
            else:
                values = self.mapped.rows(offset, 1, row_bytes)[0].view(part.target.dtype)
                with torch.no_grad():
                    part.target.copy_(values.reshape(part.target.shape))
        os.utime(self.path)  # least recently used goes first
        size = self.path.stat().st_size
        rank_zero_info(
            f"lightning-frozen: mapped the frozen base from the code cache {self.path} ({size / 2**30:.2f} GiB) in"
            f" {time.monotonic() - self._started:.1f} s, instead of reading and encoding the folder"
        )

    def keep(self, part: Part, loaded: LoadedBase) -> None:
        """``part`` was stored: its bytes go into its row of the file, and its shard becomes that row."""
        offset, row_bytes = self._offsets[part.name], part.row_bytes()
        if part.sliced:
            stored, coded = frozen_files.stored_bytes(part.target), frozen_dtype_of(part.target)
            assert stored.numel() == row_bytes, f"{part.name}: {stored.numel()} bytes stored, {row_bytes} laid out"
            row = self.mapped.rows(offset, self.rows, row_bytes)[self.rank]
            row.copy_(stored)
            frozen_files.place(part.target, self.mapped, offset, self.rows, row_bytes, self.rank, coded)
            loaded.moved(part.target)
            crc, saved = zlib.crc32(row.numpy()), loaded.saved(part.target)
            self.index["parts"][part.name] = [offset, self.rows, row_bytes, crc, saved, coded]
        else:
            row = self.mapped.rows(offset, 1, row_bytes)[0]
            if self.rank == 0:
                row.copy_(part.target.detach().reshape(-1).view(torch.uint8))
            self.index["parts"][part.name] = [offset, 1, row_bytes, zlib.crc32(row.numpy()), None, None]

    def finish(self, loaded: LoadedBase) -> None:
        """Every part was kept: the index (every rank's records) written, the file renamed into place, and each
        shard moved to a private mapping of it (a write to a shard then never reaches the file)."""
        mine = self.index["parts"]
        every = collectives.gather_objects(mine)  # the params' group is the world (`cached_load`)
        parts = {
            name: [*mine[name][:3], [ranks[name][3] for ranks in every], [ranks[name][4] for ranks in every], coded]
            for name, (*_, coded) in mine.items()
        }
        self.index["parts"] = parts
        path, written = self.path, None
        try:
            if self.rank == 0:
                frozen_files.write_index(self.mapped, json.dumps(self.index).encode())
                os.replace(self.mapped.path, path)
                written = path.stat().st_size
        finally:
            self.release()
        size = len(self.mapped.data)
        private, why = frozen_files.mapped_together(
            self.group,
            lambda: (frozen_files.open_file(path, size), None),
            lambda made: frozen_files.open_file(made, size),
        )
        if private is not None:
            for part in self.parts:
                offset, rows, row_bytes, _, _, coded = parts[part.name]
                if part.sliced:
                    frozen_files.place(part.target, private, offset, rows, row_bytes, self.rank, coded)
                    loaded.moved(part.target)
        if written is not None:
            rank_zero_info(
                f"lightning-frozen: wrote the code cache {path} ({written / 2**30:.2f} GiB): the next fit of this base"
                " maps it instead of reading the folder"
            )

    def release(self) -> None:
        """Let go of the lock (rank 0), and remove the file if it was not written whole."""
        if self._lock is not None:
            if not self.hit:
                self.mapped.path.unlink(missing_ok=True)  # renamed away once written: then nothing happens
            self._lock.close()
            self._lock = None


@contextlib.contextmanager
def cached_load(
    setting: process.CodeCacheSetting, parts: Sequence[Part], frozen_dtype: Optional[str], fingerprint_mode: str
) -> Iterator[Optional[CachedLoad]]:
    """The cache for a load of ``parts`` (every rank the same, in the same order): the file mapped, or being written,
    else None (one line on rank 0 says why). Collective over the ZeRO-3 params' process group. A file being written
    is removed if the load does not finish."""
    place = process.code_cache_place(setting)
    sliced = [part for part in parts if part.sliced]
    if place is None or not sliced:
        yield None
        return
    group, rank, rows, world = frozen_files.sharding(sliced[0].target)
    if not world:
        rank_zero_info("lightning-frozen: the code cache is not used: the frozen params are sharded over a sub-group")
        yield None
        return
    parts = sorted(parts, key=lambda part: (not part.sliced, frozen_files.creation_order(part.target)))
    name, stale_name, identity = _names(parts, frozen_dtype, fingerprint_mode, rows)
    offsets, total = frozen_files.layout([part.row_bytes() * (rows if part.sliced else 1) for part in parts])
    path = place / f"{name}{_SUFFIX}"
    state: dict[str, Any] = {}

    def offer() -> tuple[Optional[frozen_files.MappedFile], Optional[str]]:
        why = _private_folder(place)
        if why is not None:
            return None, why
        mapped, why = _open_whole(path, name)
        if mapped is not None or why is not None:
            return mapped, why
        state["lock"] = lock = _locked(place / f"{name}.lock")
        mapped, why = _open_whole(path, name)  # written by the fit that held the lock
        if mapped is not None or why is not None:
            lock.close()
            state.pop("lock")
            return mapped, why
        stale = _remove_stale(place, stale_name, identity)
        process.remove_dead_files(place, _PARTIAL)
        room = _make_room(place, total)
        if room is not None:
            return None, room
        mapped, why = frozen_files.reserve(place / process.owned_name("partial", _SUFFIX), total)
        if mapped is not None:
            rank_zero_info(f"lightning-frozen: writing the code cache {path} ({total / 2**30:.2f} GiB){stale}")
        else:
            lock.close()
        return mapped, why

    def reopen(made: Path) -> Optional[frozen_files.MappedFile]:
        if made.suffix == _SUFFIX and made.name == path.name:
            return _open_whole(path, name)[0]
        return frozen_files.open_file(place / made.name, total, writable=True)

    mapped, why = frozen_files.mapped_together(group, offer, reopen)
    if mapped is None:
        rank_zero_info(f"lightning-frozen: the code cache is not used: {why}; the folder is read and encoded as before")
        yield None
        return
    hit = mapped.path == path
    load = CachedLoad(list(parts), mapped, path, hit, rank, rows, group, _lock=state.get("lock"))
    if hit:
        load.index = json.loads(frozen_files.read_index(path)[1])
    else:
        load.index = {"name": name, "version": _package_version(), "folder": identity, "parts": {}}
        load._offsets = {part.name: offset for part, offset in zip(parts, offsets)}
    try:
        yield load
    finally:
        load.release()


def _names(parts: Sequence[Part], frozen_dtype: Optional[str], mode: str, rows: int) -> tuple[str, str, list]:
    """The file's name (all that determines its bytes), the name's start that the same folder, ``frozen_dtype`` and
    layout share whatever their contents (to find a stale file), and the folder's identity."""
    files = sorted({file for part in parts for file in part.files})
    identity = [_identity(file) for file in files]
    layout = [[p.name, str(p.target.dtype), p.sliced, p.row_bytes(), p.frozen_dtype] for p in parts]
    where = _digest([_FORMAT, [os.path.realpath(file) for file in files], frozen_dtype, mode, rows, layout])[:16]
    return f"{where}-{_digest([_package_version(), identity])[:24]}", where, identity


def _identity(file: str) -> list:
    status = os.stat(file)
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = handle.read(min(length, 100 << 20))
    return [os.path.realpath(file), status.st_size, status.st_mtime_ns, hashlib.sha256(header).hexdigest()]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def _package_version() -> str:
    try:
        return metadata.version("lightning-frozen")
    except metadata.PackageNotFoundError:
        return "unknown"


def _private_folder(place: Path) -> Optional[str]:
    """None where ``place`` (made now if missing) is a folder only this user can write, else why not."""
    try:
        place.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = place.stat()
    except OSError as error:
        return f"{place} cannot be made ({error.strerror})"
    if status.st_uid != os.geteuid() or status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{place} could be written by another user (`chmod 700` it, or set {ENVIRONMENT})"
    if not os.access(place, os.W_OK | os.X_OK, effective_ids=True):
        return f"{place} cannot be written"
    return None


def _open_whole(path: Path, name: str) -> tuple[Optional[frozen_files.MappedFile], Optional[str]]:
    """``path`` mapped privately where it is whole and its index names it ``name``; else None, and why where it is
    such a file but cannot be mapped (then it is not written again either)."""
    found = frozen_files.read_index(path)
    try:
        index = json.loads(found[1]) if found is not None else {}
    except ValueError:
        index = {}
    if index.get("name") != name:
        return None, None
    mapped = frozen_files.open_file(path, found[0])
    return mapped, None if mapped is not None else f"{path} cannot be mapped, or another user could write it"


def _locked(path: Path) -> IO[bytes]:
    """``path`` opened and locked for this process (waiting, with a line, while another fit holds it)."""
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+b")  # noqa: SIM115 (held until released)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        rank_zero_info(f"lightning-frozen: waiting for another fit on this machine to write the code cache ({path})")
        fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def _remove_stale(place: Path, stale_name: str, identity: list) -> str:
    """Remove the files of the same folder, ``frozen_dtype`` and layout that no longer match; say why."""
    why = ""
    for stale in place.glob(f"{stale_name}-*{_SUFFIX}"):
        found = frozen_files.read_index(stale)
        try:
            index = json.loads(found[1]) if found is not None else None
        except ValueError:
            index = None
        if not isinstance(index, dict):
            why = "; the one there was cut short or damaged"
        elif index.get("version") != _package_version():
            why = f"; the one there was written by lightning-frozen {index.get('version')}"
        elif index.get("folder") != identity:
            changed = [new[0] for old, new in zip(index["folder"], identity) if old != new] or ["its files"]
            why = f"; the folder changed since the last one was written ({', '.join(changed)})"
        else:
            why = "; the one there is not this base's"
        stale.unlink(missing_ok=True)
    return why


def _make_room(place: Path, needed: int) -> Optional[str]:
    """Remove the least recently used files until ``needed`` more bytes fit the limit and leave the disk
    ``FREE_MARGIN`` free; None, or why it cannot (then nothing is removed)."""
    limit = int(float(os.environ.get(LIMIT_ENVIRONMENT) or DEFAULT_LIMIT_GB) * 2**30)
    files = [(file, file.stat()) for file in place.glob(f"*{_SUFFIX}") if not _PARTIAL.match(file.name)]
    files.sort(key=lambda found: found[1].st_mtime)
    stats = os.statvfs(place)
    free, held = stats.f_bavail * stats.f_frsize, sum(status.st_size for _, status in files)
    if needed > limit or needed + FREE_MARGIN > free + held:
        return (
            f"it needs {needed / 2**30:.2f} GiB and {place} has {free / 2**30:.2f} GiB free within a limit of"
            f" {limit / 2**30:.2f} GiB ({LIMIT_ENVIRONMENT})"
        )
    for file, status in files:
        if held + needed <= limit and needed + FREE_MARGIN <= free:
            break
        file.unlink(missing_ok=True)
        held, free = held - status.st_size, free + status.st_size
    return None


def verify(path: Path) -> list[str]:
    """What is wrong with the cache file at ``path``, read whole: each row's CRC against its index, and its folder's
    files against the identity they had (an empty list: nothing)."""
    found = frozen_files.read_index(path)
    if found is None:
        return [f"{path}: not whole (no index at its end)"]
    index = json.loads(found[1])
    mapped = frozen_files.open_file(path, found[0])
    if mapped is None:
        return [f"{path}: cannot be mapped, or could be written by another user"]
    problems = [f"{path}: {name} row {row} differs from when it was written" for name, row in _bad_rows(mapped, index)]
    for old in index.get("folder", []):
        try:
            if _identity(old[0]) != old:
                problems.append(f"{path}: {old[0]} changed since it was written")
        except OSError:
            problems.append(f"{path}: {old[0]} is gone")
    return problems


def _bad_rows(mapped: frozen_files.MappedFile, index: dict) -> Iterator[tuple[str, int]]:
    for name, (offset, rows, row_bytes, crcs, *_) in index["parts"].items():
        crcs = crcs if isinstance(crcs, list) else [crcs]
        for row, values in enumerate(mapped.rows(offset, rows, row_bytes)[: len(crcs)]):
            if zlib.crc32(values.numpy()) != crcs[row]:
                yield name, row


def entries(place: Optional[Path] = None) -> list[tuple[Path, int, float]]:
    """The cache's files: path, bytes and last use (seconds since the epoch), most recent first."""
    place = place or process.code_cache_place(True)
    if place is None or not place.is_dir():
        return []
    found = [(file, file.stat()) for file in place.glob(f"*{_SUFFIX}") if not _PARTIAL.match(file.name)]
    return sorted(((file, s.st_size, s.st_mtime) for file, s in found), key=lambda entry: -entry[2])
