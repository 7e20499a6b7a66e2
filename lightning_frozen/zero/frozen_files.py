"""Frozen ZeRO-3 shards held in a file the ranks of one machine map, rather than in each process's own memory.

Each param's shards (codes, or values in the param's dtype) lie in the file as an all-gather returns them, one row a
rank, so a gather reads the other ranks' rows where they lie instead of copying them through the process group. One
mechanism, two places: the code cache on disk (``base/code_cache.py``), which later fits map again instead of reading
and encoding the folder, and, for shards quantized at setup, a file in ``/dev/shm`` unlinked once every rank mapped it
(:func:`share_codes`). A mapped file's pages are the kernel's page cache, not the process's memory: a base larger
than memory is read as it is used, the next params' pages asked for first (:func:`read_ahead`), and pages used are
left for the kernel to drop. Why and what it saves: docs/frozen-storage.md, "Ranks on one machine share the codes".
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_frozen import process
from lightning_frozen.zero.frozen_storage import keeps_a_copy, store_encoded

SHARED_DIR = Path("/dev/shm")
HEAD = 4096  # bytes at the file's head: magic, where its index lies, the token that proves ranks opened one file
_MAGIC = b"LFFROZ01"
_HEAD_FORMAT = "<8sQQ32s"  # magic, index offset, index length, token
_MADV_POPULATE_READ = 22
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's; Python names it from 3.13
_READ_AHEAD_BYTES = 64 << 20  # at least this far ahead of a gathered param, in the direction the gathers go
_PREFIX = "lightning-frozen"
_NAME = process.owned_names(_PREFIX)
# kept here rather than on the user's params: a param whose every rank's row is in a mapped file, its rows and span
_rows: WeakIdKeyDictionary = WeakIdKeyDictionary()
_spans: WeakIdKeyDictionary = WeakIdKeyDictionary()
_counted: WeakIdKeyDictionary = WeakIdKeyDictionary()
_owned = [0]  # bytes of this rank's rows in shared /dev/shm files, of params alive (memory accounting)


@dataclass
class MappedFile:
    """One file mapped whole: ``data`` (uint8) over its bytes. ``writable``: mapped shared, writes reach the file
    (while it is written); else mapped private, a write stays in the process."""

    path: Path
    data: torch.Tensor
    writable: bool
    _map: mmap.mmap = field(repr=False)
    _advised: list[int] = field(default_factory=lambda: [0, 0, 0], repr=False)  # span read ahead, last gathered

    @property
    def token(self) -> str:
        return struct.unpack_from(_HEAD_FORMAT, self._map)[3].decode(errors="replace")

    def index_span(self) -> tuple[int, int]:
        """(offset, length) of the index written at the end, or (0, 0)."""
        magic, offset, length, _ = struct.unpack_from(_HEAD_FORMAT, self._map)
        return (offset, length) if magic == _MAGIC else (0, 0)

    def rows(self, offset: int, rows: int, row_bytes: int) -> torch.Tensor:
        return self.data[offset : offset + rows * row_bytes].view(rows, row_bytes)

    def read_ahead(self, start: int, end: int) -> None:
        """[start, end) is being gathered: ask the kernel to read the pages beyond it, in the direction the gathers
        go (forward, or back in a backward), unless asked already."""
        page, (first, last, previous) = mmap.PAGESIZE, self._advised
        span = max(_READ_AHEAD_BYTES, 4 * (end - start))
        low, high = (end, end + span) if start >= previous else (max(HEAD, start - span), start)
        low, high = low // page * page, min(len(self._map), -(-high // page) * page)
        self._advised[2] = start
        if high <= low or (first <= low and high <= last):
            return
        self._advised[:2] = [low, high]
        self.advise(mmap.MADV_WILLNEED, low, high - low)

    def advise(self, advice: int, start: int = 0, length: int = 0) -> None:
        """``madvise`` over [start, start + length) (the whole file for 0); where it is refused, pages come as they
        are read."""
        with contextlib.suppress(OSError, ValueError):
            self._map.madvise(advice, start, length or len(self._map) - start)


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each param's offset (its rows, ``sizes`` bytes, on pages of their own) and the end of the last."""
    offsets, end, page = [], HEAD, mmap.PAGESIZE
    for size in sizes:
        offsets.append(end)
        end += -(-size // page) * page
    return offsets, end


def reserve(path: Path, size: int) -> tuple[Optional[MappedFile], Optional[str]]:
    """Make ``path`` (this user's alone) with ``size`` bytes reserved, mapped shared, a new token in its head; or
    (None, why not)."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, size)  # ENOSPC here, not SIGBUS at a write
        finally:
            os.close(descriptor)
    except OSError as error:
        path.unlink(missing_ok=True)
        return None, _no_room(path, size, error)
    mapped = open_file(path, size, writable=True)
    if mapped is None:
        path.unlink(missing_ok=True)
        return None, f"{path} could not be mapped"
    struct.pack_into(_HEAD_FORMAT, mapped._map, 0, b"", 0, 0, secrets.token_hex(16).encode())
    return mapped, None


def open_file(path: Path, size: int, writable: bool = False) -> Optional[MappedFile]:
    """Map the first ``size`` bytes of ``path`` (shared where ``writable``, else private); None if it is missing,
    shorter, or not a regular file of this user's that no other user may write."""
    try:
        descriptor = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError:
        return None
    try:
        status = os.fstat(descriptor)
        if not _owned_file(status) or status.st_size < size:
            return None
        # private and writable, it would reserve its size in memory: refused beyond memory + swap unless not reserved
        flags = mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE | _MAP_NORESERVE
        mapped = mmap.mmap(descriptor, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(descriptor)
    return MappedFile(path, torch.frombuffer(mapped, dtype=torch.uint8), writable, mapped)


def write_index(mapped: MappedFile, index: bytes) -> None:
    """Append ``index`` after the rows and record where it lies in the head; the file is whole once it is renamed
    to its name (``os.replace``)."""
    end = len(mapped._map)
    with open(mapped.path, "r+b") as file:
        file.seek(end)
        file.write(index)
        file.flush()
        mapped._map.flush()
        struct.pack_into("<QQ", mapped._map, 8, end, len(index))
        struct.pack_into("<8s", mapped._map, 0, _MAGIC)
        mapped._map.flush()
        os.fsync(file.fileno())


def read_index(path: Path) -> Optional[tuple[int, bytes]]:
    """(the rows' size, the index) of a whole file at ``path``, else None."""
    try:
        with open(path, "rb") as file:
            head = file.read(struct.calcsize(_HEAD_FORMAT))
            magic, offset, length, _ = struct.unpack(_HEAD_FORMAT, head)
            if magic != _MAGIC or os.fstat(file.fileno()).st_size != offset + length:
                return None
            file.seek(offset)
            return offset, file.read(length)
    except (OSError, struct.error):
        return None


def place(
    param: nn.Parameter,
    mapped: MappedFile,
    offset: int,
    rows: int,
    row_bytes: int,
    rank: int,
    frozen_dtype: Optional[str],
) -> None:
    """``param``'s shard becomes its row ``rank`` of the ``rows`` of ``row_bytes`` at ``offset`` in ``mapped`` (codes in
    ``frozen_dtype``, else values in its dtype); with every rank's row there, gathers read them where they lie."""
    shard = param.ds_tensor
    all_rows = mapped.rows(offset, rows, row_bytes)
    mine = all_rows[rank]
    if frozen_dtype is None:
        shard.data = mine.view(shard.dtype)
    else:
        store_encoded(param, mine, frozen_dtype, pin=False)  # the file's pages, never copied into page-locked memory
        if rows > 1:
            _rows[param] = all_rows
            keeps_a_copy(param, leave)  # codes written or values restored: gathered through the process group again
    _spans[param] = (mapped, offset, offset + all_rows.numel())  # its views hold the mapping as long anyway


def sharding(param: nn.Parameter) -> tuple[Any, int, int, bool]:
    """The process group ``param`` is sharded over, this rank's index in it, its size, and whether it is the world."""
    import deepspeed.comm as dist

    group = param.ds_process_group
    size = dist.get_world_size(group=group)
    return group, dist.get_rank(group=group), size, size == dist.get_world_size()


def stored_bytes(param: nn.Parameter) -> torch.Tensor:
    """This rank's shard of ``param`` as it is stored, as bytes (codes as they are, values viewed as ``uint8``)."""
    shard = param.ds_tensor.data
    return shard if shard.dtype == torch.uint8 else shard.view(torch.uint8)


def creation_order(tensor: torch.Tensor) -> int:
    """Where ``tensor`` came in the model's creation (ZeRO-3's id; 0 for a tensor that is no ZeRO-3 param): the order
    forwards gather params in, roughly, and so the order a file lays them out in for reading ahead."""
    return int(getattr(tensor, "ds_id", 0))


def rows_of(param: nn.Parameter) -> Optional[torch.Tensor]:
    """Every rank's codes of ``param`` in a mapped file (``world_size`` rows, as an all-gather returns them), else
    None."""
    return _rows.get(param)


def file_of(param: nn.Parameter) -> Optional[Path]:
    """The mapped file ``param``'s shard lies in, else None."""
    span = _spans.get(param)
    mapped = span[0] if span is not None else None
    return None if mapped is None else mapped.path


def read_ahead(param: nn.Parameter) -> None:
    """``param`` is being gathered: ask for the pages of the params beyond it in its file (those before it in a
    backward), so that the disk reads them while this one computes."""
    span = _spans.get(param)
    mapped = span[0] if span is not None else None
    if mapped is not None:
        mapped.read_ahead(span[1], span[2])


def leave(param: nn.Parameter) -> None:
    """``param``'s codes are being replaced (a write under ``GatheredParameters``, or its values restored): it is
    gathered through the process group from now on. Every rank calls this for the same param."""
    _spans.pop(param, None)
    if _rows.pop(param, None) is not None:
        counted = _counted.pop(param, None)
        if counted is not None and counted.alive:
            counted()  # takes its bytes off the count, once


def owned_bytes() -> int:
    """Bytes of codes this process wrote into shared-memory files, of params still alive (each rank counts its own
    rows: the sum over a machine's ranks is what the files in /dev/shm hold)."""
    return _owned[0]


def mapped_together(
    group: Any, offer: Callable[[], tuple[Optional[MappedFile], Optional[str]]], reopen: Callable[[Path], object]
) -> tuple[Optional[MappedFile], Optional[str]]:
    """Rank 0 of ``group`` maps a file (``offer()``: the mapping, or why not); each other rank opens that path
    (``reopen(path)``: a mapping or None) and checks it is the file rank 0 holds (its token) on this machine. The
    mapping, or (None, why) on every rank alike. Collective."""
    import deepspeed.comm as dist

    rank, mapped, why = dist.get_rank(group=group), None, None
    try:
        message: list[Optional[str]] = [None, None, None, process.machine_tag()]
        if rank == 0:
            mapped, why = offer()
            message[:3] = [None if mapped is None else str(mapped.path), None if mapped is None else mapped.token, why]
        dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
        path, token, why, machine = message
        if rank != 0 and path is not None and machine == process.machine_tag():
            opened = reopen(Path(path))
            mapped = opened if isinstance(opened, MappedFile) and opened.token == token else None
        agreed = torch.tensor([0 if mapped is None else 1], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    except BaseException:
        mapped = None  # unmapped now, not when the traceback goes
        raise
    if int(agreed) == 0:
        return None, why or "not every rank could open it (they are not all on one machine with one file system)"
    return mapped, None


def share_codes(
    params: list[nn.Parameter], frozen_dtype_of: Callable[[nn.Parameter], Optional[str]], spill: Optional[Path] = None
) -> int:
    """Move this rank's codes of ``params`` (quantized ZeRO-3 shards in CPU memory, one process group, none in a
    mapped file yet) into a file that every rank of the group maps: in ``/dev/shm``, else, where it has no room (a
    container's), in ``spill`` (the code cache's folder: on disk, read through the page cache). Return how many moved
    (0 where the ranks cannot share one). Collective over the params' process group, every rank passing the same
    params."""
    import deepspeed.comm as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    params = sorted((p for p in params if p not in _spans and frozen_dtype_of(p) is not None), key=_ds_id)
    if not params or any(p.ds_tensor.device.type != "cpu" for p in params):
        return 0
    group = params[0].ds_process_group
    if any(p.ds_process_group is not group for p in params):
        return 0
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if world == 1:
        return 0
    offsets, total = layout([world * p.ds_tensor.numel() for p in params])
    sizes = torch.tensor([total, -total], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):  # the ranks disagree on the params: keep the collective
        return 0
    places = [SHARED_DIR] + ([spill] if spill is not None else [])
    made: list[Path] = []

    def offer() -> tuple[Optional[MappedFile], Optional[str]]:
        whys = []
        for place in places:
            process.remove_dead_files(place, _NAME)  # of jobs killed mid-handshake
            made.append(place / process.owned_name(_PREFIX))
            with contextlib.suppress(OSError):
                place.mkdir(mode=0o700, parents=True, exist_ok=True)
            mapped, why = reserve(made[-1], total)
            if mapped is not None:
                return mapped, None
            whys.append(why)
        return None, "; ".join(whys)

    def reopen(path: Path) -> Optional[MappedFile]:  # by its name in this rank's own folder: the file rank 0 made
        place = next((place for place in places[1:] if path.parent == place), SHARED_DIR)
        return open_file(place / path.name, total, writable=True)

    try:
        mapped, why = mapped_together(group, offer, reopen)
    finally:
        for path in made:
            path.unlink(missing_ok=True)  # every rank has it mapped, or gave it up, or raised
    if mapped is None:
        rank_zero_warn(f"The frozen codes are exchanged through the process group at every gather: {why}.")
        return 0
    placed: list[nn.Parameter] = []
    try:
        for param, offset in zip(params, offsets):
            local = param.ds_tensor.data
            mapped.rows(offset, world, local.numel())[rank].copy_(local)
            place(
                param, mapped, offset, world, local.numel(), rank, frozen_dtype_of(param)
            )  # its private copy freed here
            placed.append(param)
        dist.barrier(group=group)  # every rank's rows are written before any rank reads them
        mapped.advise(_MADV_POPULATE_READ)  # mapped here, not page by page in the first step (Linux 5.14)
        dist.barrier(group=group)
    except BaseException:
        for param in placed:  # another rank's rows may be unwritten: gather these through the process group
            leave(param)
        raise
    for param in params:
        size = param.ds_tensor.numel()
        _owned[0] += size
        _counted[param] = weakref.finalize(param, _uncount, size)
    return len(params)


def _ds_id(param: nn.Parameter) -> int:
    return param.ds_id


def _uncount(size: int) -> None:
    _owned[0] -= size


def _owned_file(status: os.stat_result) -> bool:
    writable_by_others = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return stat.S_ISREG(status.st_mode) and status.st_uid == os.geteuid() and not writable_by_others


def _no_room(path: Path, total: int, error: OSError) -> str:
    if error.errno not in (errno.ENOSPC, errno.EFBIG):
        return f"{path} could not be made ({error.strerror})"
    try:
        stats = os.statvfs(path.parent)
        free = f"{stats.f_bavail * stats.f_frsize / 2**30:.2f} GiB free"
    except OSError:
        free = "no room"
    tmpfs = "; in a container, raise its --shm-size" if path.parent == SHARED_DIR else ""
    return f"{path.parent} has {free} and the codes take {total / 2**30:.2f} GiB ({error.strerror}{tmpfs})"
