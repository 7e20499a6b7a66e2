"""Frozen codes shared by the ranks of one machine: every rank's encoded shards in one shared-memory file that all of
them map, laid out as an all-gather would return them, so that a gather reads the other ranks' codes where they lie
instead of copying them through the process group. Only on the CPU, where every rank can map rank 0's file and it has
room; else the codes are exchanged as before, and rank 0 says why once. Why, what it saves, and how the file is
reserved, unlinked and swept: docs/frozen-storage.md, "Ranks on one machine share the codes".
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_frozen import process
from lightning_frozen.format.codec import split
from lightning_frozen.zero.frozen_storage import keeps_a_copy

SHARED_DIR = Path("/dev/shm")
ALIGN = 64  # bytes: each param's rows start on a cache line
# kept here rather than on the user's params: for a param whose codes are in the shared file, its rows (one per rank)
# and the finalizer that takes its bytes off the count when it dies
_rows: WeakIdKeyDictionary = WeakIdKeyDictionary()
_counted: WeakIdKeyDictionary = WeakIdKeyDictionary()
_MADV_POPULATE_READ = 22  # Linux 5.14
_HEADER = 64  # bytes at the file's head: rank 0's token, which proves the other ranks opened the same file
_owned = [0]  # bytes of this rank's shards in shared files, of params alive (memory accounting)
_PREFIX = "lightning-frozen"
_NAME = process.owned_names(_PREFIX)


def share_codes(params: list[nn.Parameter], frozen_dtype_of: Callable[[nn.Parameter], Optional[str]]) -> int:
    """Move this rank's codes of ``params`` (quantized ZeRO-3 shards in CPU memory, one process group) into a
    shared-memory file that every rank of the group maps; return how many moved (0 where the ranks cannot share one).
    Collective over the params' process group, every rank passing the same params."""
    import deepspeed.comm as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    params = sorted((p for p in params if rows_of(p) is None and frozen_dtype_of(p) is not None), key=_ds_id)
    if not params or any(p.ds_tensor.device.type != "cpu" for p in params):
        return 0
    group = params[0].ds_process_group
    if any(p.ds_process_group is not group for p in params):
        return 0
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if world == 1:
        return 0
    offsets, total = _layout([p.ds_tensor.numel() for p in params], world)
    sizes = torch.tensor([total, -total], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):  # the ranks disagree on the params: keep the collective
        return 0
    name = _new_name() if rank == 0 else None
    mapped = None
    try:
        offer: list[Optional[str]] = [None, None, None]  # file name, token, why not
        if rank == 0:
            offer, mapped = _offer(SHARED_DIR / name, total)
        dist.broadcast_object_list(offer, src=dist.get_global_rank(group, 0), group=group)
        shared_name, token, why_not = offer
        if rank != 0 and shared_name is not None:
            mapped = _open(SHARED_DIR / shared_name, token, total)  # this machine's, which may not be rank 0's
        opened = torch.tensor([0 if mapped is None else 1], dtype=torch.int64)
        dist.all_reduce(opened, op=dist.ReduceOp.MIN, group=group)
    except BaseException:
        mapped = None  # unmapped now, not when the traceback goes
        raise
    finally:
        if name is not None:
            (SHARED_DIR / name).unlink(missing_ok=True)  # every rank has it mapped, or gave it up, or raised
    if int(opened) == 0:
        if why_not is None:
            why_not = "not every rank could open it (they are not all on one machine with one /dev/shm)"
        rank_zero_warn(f"The frozen codes are exchanged through the process group at every gather: {why_not}.")
        return 0
    assert mapped is not None
    placed: list[nn.Parameter] = []
    try:
        for param, offset in zip(params, offsets):
            local = param.ds_tensor.data
            rows = mapped[offset : offset + world * local.numel()].view(world, local.numel())
            rows[rank].copy_(local)
            _place(param, rows, rank, frozen_dtype_of(param))  # its private copy freed here, one param at a time
            placed.append(param)
        dist.barrier(group=group)  # every rank's rows are written before any rank reads them
        _map_pages(mapped)  # here, not page by page in the first step; and no rank's USS holds them after
        dist.barrier(group=group)
    except BaseException:
        for param in placed:  # another rank's rows may be unwritten: gather these through the process group
            leave(param)
        raise
    for param in params:
        _count(param)
    return len(params)


def rows_of(param: nn.Parameter) -> Optional[torch.Tensor]:
    """Every rank's codes of ``param`` in the shared file (``world_size`` rows, as an all-gather returns them), else
    None."""
    return _rows.get(param)


def leave(param: nn.Parameter) -> None:
    """``param``'s codes are being replaced (a write under ``GatheredParameters``, or its values restored): it is
    gathered through the process group from now on. Every rank calls this for the same param."""
    if rows_of(param) is not None:
        del _rows[param]
        counted = _counted.pop(param, None)
        if counted is not None and counted.alive:
            counted()  # takes its bytes off the count, once


def owned_bytes() -> int:
    """Bytes of shared codes this process wrote, of params still alive (each rank counts its own shards: the sum over
    a machine's ranks is what the shared files hold)."""
    return _owned[0]


def _ds_id(param: nn.Parameter) -> int:
    return param.ds_id


def _layout(shard_bytes: list[int], world: int) -> tuple[list[int], int]:
    offsets, end = [], _HEADER
    for size in shard_bytes:
        offsets.append(end)
        end += -(-world * size // ALIGN) * ALIGN
    return offsets, end


def _new_name() -> str:
    """A name for rank 0's file that says which process made it: ``lightning-frozen-<pid space>-<pid>-<random>``."""
    return process.owned_name(_PREFIX)


def _offer(path: Path, total: int) -> tuple[list[Optional[str]], Optional[torch.Tensor]]:
    """On rank 0: remove the files of dead jobs, make ``path`` with ``total`` bytes reserved, map it and write its
    token; ([name, token, None], the mapping), or ([None, None, why not], None)."""
    process.remove_dead_files(SHARED_DIR, _NAME)  # of jobs killed mid-handshake
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, total)  # ENOSPC here, not SIGBUS at a write
        finally:
            os.close(descriptor)
    except OSError as error:
        return [None, None, _no_room(path, total, error)], None
    mapped = _open(path, None, total)
    if mapped is None:
        return [None, None, f"{path} could not be mapped"], None
    token = secrets.token_hex(16)
    mapped[: len(token)].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
    return [path.name, token, None], mapped


def _no_room(path: Path, total: int, error: OSError) -> str:
    if error.errno not in (errno.ENOSPC, errno.EFBIG):
        return f"{path} could not be made ({error.strerror})"
    try:
        stats = os.statvfs(path.parent)
        free = f"{stats.f_bavail * stats.f_frsize / 2**30:.2f} GiB free"
    except OSError:
        free = "no room"
    return (
        f"{path.parent} has {free} and the codes take {total / 2**30:.2f} GiB ({error.strerror}; in a container, raise"
        " its --shm-size)"
    )


def _open(path: Path, token: Optional[str], total: int) -> Optional[torch.Tensor]:
    """Map ``path`` shared, ``total`` bytes long; None if it is not there, shorter, or not the file whose head holds
    ``token``."""
    try:
        if path.stat().st_size < total:  # `from_file` would make the file, or lengthen it unreserved
            return None
        mapped = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    except (RuntimeError, OSError):
        return None
    if token is not None and bytes(mapped[: len(token)].tolist()) != token.encode():
        return None
    return mapped


def _place(param: nn.Parameter, rows: torch.Tensor, rank: int, frozen_dtype: str) -> None:
    shard = param.ds_tensor
    shard.data = rows[rank]
    shard.ds_quant_scale = split(rows[rank], frozen_dtype)[1]  # not a view of the private copy: that is freed
    _rows[param] = rows
    keeps_a_copy(param, leave)  # codes written or values restored: gathered through the process group again


def _count(param: nn.Parameter) -> None:
    size = rows_of(param).shape[1]
    _owned[0] += size
    _counted[param] = weakref.finalize(param, _uncount, size)


def _uncount(size: int) -> None:
    _owned[0] -= size


def _map_pages(mapped: torch.Tensor) -> None:
    """Map every page of the shared file into this process now (``MADV_POPULATE_READ``; else one byte per page read)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(mapped.data_ptr()), ctypes.c_size_t(mapped.numel()), _MADV_POPULATE_READ) == 0:
            return
    except (OSError, AttributeError):
        pass
    mapped[:: mmap.PAGESIZE].max()
