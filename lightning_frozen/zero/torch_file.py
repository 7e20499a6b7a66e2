"""A ``torch.save`` file written in two passes, so that its largest tensors never have to be in memory together: first
its structure, with the place of every tensor's bytes reserved and left empty (``torch.serialization.skip_data``), then
each tensor's bytes at its place, whenever the caller has them.

The file is the one ``torch.save`` writes (a zip archive, ``weights_only`` loadable, ``mmap`` loadable): the same
records, and each record's CRC-32 is put back once its bytes are in (torch has no switch that writes it later:
``compute_crc32=False`` leaves 0, which ``unzip -t`` refuses). A tensor not there yet is given as a tensor on the meta
device; the first pass writes in its place a CPU tensor of its shape and dtype over anonymous pages that nobody touches
(no memory), whose bytes ``skip_data`` leaves out. Where each storage's bytes go is read with public means too: the
structure loaded with ``mmap=True`` puts each storage at its record's offset from the mapping's start, and the zip's
directory lists the records in file order.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Collection
from typing import IO, Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_frozen.errors import CheckpointFormatError

# zip records (APPNOTE 4.3): a local header's CRC-32 and name and extra lengths, a central header's CRC-32, the data
# descriptor miniz writes after each record's bytes (its signature, then the CRC-32)
_LOCAL_CRC, _LOCAL_LENGTHS, _LOCAL_SIZE = 14, 26, 30
_CENTRAL_SIGNATURE, _CENTRAL_CRC, _CENTRAL_LENGTHS, _CENTRAL_SIZE = b"PK\x01\x02", 16, 28, 46
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_STORAGE_RECORD = re.compile(r"[^/]+/data/\d+")  # torch.save's record of one storage's bytes

Put = Callable[[torch.Tensor, torch.Tensor], None]


def save_in_two_passes(
    obj: Any, handle: IO[bytes], later: Collection[torch.Tensor], fill: Callable[[Put], None]
) -> None:
    """``torch.save(obj, handle)`` (open for reading and writing), where the tensors of ``later`` (on the meta device)
    are written when ``fill(put)`` calls ``put(tensor, value)`` with their values, in any order; ``fill`` runs once.
    A tensor of ``later`` that ``obj`` does not hold is skipped.

    Raises:
        CheckpointFormatError: ``obj`` holds another tensor on the meta device (it has no bytes to write), or
            ``fill`` left a tensor of ``later`` that ``obj`` holds without its value.
    """
    later_ids = {id(tensor) for tensor in later}
    stray = [t for t in _tensors(obj) if t.device.type == "meta" and id(t) not in later_ids]
    if stray:
        raise CheckpointFormatError(
            f"The checkpoint holds a tensor of shape {tuple(stray[0].shape)} on the meta device, which has no values"
            " to save. A hook that changes the checkpoint's `state_dict` or `optimizer_states` (`on_save_checkpoint`)"
            " may move or drop their tensors, but not compute new ones from them: they are filled as the file is"
            " written."
        )
    untouched = {id(t): _untouched_like(t) for t in _tensors(obj) if id(t) in later_ids}
    with torch.serialization.skip_data():
        torch.save(with_values(obj, untouched), handle)
    del untouched
    handle.flush()
    places = _places(obj, handle)
    descriptor = handle.fileno()
    crcs: dict[int, int] = {}

    def write(offset: int, data: torch.Tensor) -> None:
        view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        crcs[offset] = zlib.crc32(view)
        written = 0
        while written < len(view):
            written += os.pwrite(descriptor, view[written:], offset + written)

    waiting = {id(tensor): offset for tensor, offset in places if id(tensor) in later_ids}
    for tensor, offset in places:
        if id(tensor) not in later_ids:
            write(offset, _storage_bytes(tensor))

    def put(tensor: torch.Tensor, value: torch.Tensor) -> None:
        if (value.shape, value.dtype) != (tensor.shape, tensor.dtype):
            raise CheckpointFormatError(
                f"A tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} was given a value of shape"
                f" {tuple(value.shape)} and dtype {value.dtype}."
            )
        offset = waiting.pop(id(tensor), None)
        if offset is not None:
            write(offset, value.detach().cpu().contiguous())

    fill(put)
    if waiting:
        raise CheckpointFormatError(f"{len(waiting)} tensor(s) of the checkpoint were never given their values.")
    _put_back_crcs(handle, crcs)


def _untouched_like(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``tensor``'s shape and dtype over anonymous pages nobody writes: they take no memory, and
    ``skip_data`` reads none of them."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(obj, torch.Tensor, found.append)
    return found


def with_values(obj: Any, by_id: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor whose ``id`` is a key of ``by_id`` replaced by its value there (containers copied,
    everything else shared)."""
    return apply_to_collection(obj, torch.Tensor, lambda tensor: by_id.get(id(tensor), tensor))


def _places(saved: Any, handle: IO[bytes]) -> list[tuple[torch.Tensor, int]]:
    """Each tensor of ``saved`` that has bytes, with the offset of its storage's bytes in the file ``handle`` holds
    ``saved``'s structure in (see the module's docstring).

    Raises:
        CheckpointFormatError: the mapped storages and the zip's storage records do not line up.
    """
    loaded = torch.load(f"/dev/fd/{handle.fileno()}", mmap=True, weights_only=True)  # the handle may have no path
    pairs: list[tuple[torch.Tensor, int]] = []
    pending = [(saved, loaded)]
    while pending:
        a, b = pending.pop()
        if torch.is_tensor(a) and b.untyped_storage().nbytes():
            pairs.append((a, b.untyped_storage().data_ptr()))
        elif isinstance(a, dict):
            pending.extend((value, b[key]) for key, value in a.items())
        elif isinstance(a, (list, tuple)):
            pending.extend(zip(a, b))
    del loaded  # the file is mapped no longer
    archive = zipfile.ZipFile(handle)
    starts = sorted(_data_start(handle, i) for i in archive.infolist() if _STORAGE_RECORD.fullmatch(i.filename))
    starts = [start for start, size in starts if size]
    pointers = sorted({pointer for _, pointer in pairs})
    if len(pointers) != len(starts) or len({p - s for p, s in zip(pointers, starts)}) > 1:
        raise CheckpointFormatError("The checkpoint being written maps its storages where its zip records do not lie.")
    base = pointers[0] - starts[0] if starts else 0
    return [(tensor, pointer - base) for tensor, pointer in pairs]


def _data_start(handle: IO[bytes], info: zipfile.ZipInfo) -> tuple[int, int]:
    """Where the bytes of the zip record ``info`` start in ``handle``, and how many there are."""
    handle.seek(info.header_offset + _LOCAL_LENGTHS)
    name_length, extra_length = struct.unpack("<HH", handle.read(4))
    return info.header_offset + _LOCAL_SIZE + name_length + extra_length, info.file_size


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s whole storage (what ``torch.save`` writes for it), on the CPU."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage if storage.device.type == "cpu" else storage.cpu())


def _put_back_crcs(handle: IO[bytes], crcs: dict[int, int]) -> None:
    """Write the CRC-32 of each record whose bytes start at an offset of ``crcs`` into its local header, its data
    descriptor and its central directory entry, where the first pass left 0."""
    handle.seek(0)
    archive = zipfile.ZipFile(handle)
    records = {}
    for info in archive.infolist():
        start = _data_start(handle, info)[0]
        if start in crcs:
            records[info.filename] = (info, start, crcs[start])
    descriptor = handle.fileno()
    position = archive.start_dir
    for _ in archive.infolist():
        handle.seek(position)
        header = handle.read(_CENTRAL_SIZE)
        if header[:4] != _CENTRAL_SIGNATURE:
            raise CheckpointFormatError("The checkpoint being written has no zip central directory where torch put it.")
        lengths = struct.unpack("<HHH", header[_CENTRAL_LENGTHS : _CENTRAL_LENGTHS + 6])
        name = handle.read(lengths[0]).decode()
        if name in records:
            info, start, crc = records[name]
            packed = struct.pack("<I", crc)
            os.pwrite(descriptor, packed, info.header_offset + _LOCAL_CRC)
            os.pwrite(descriptor, packed, position + _CENTRAL_CRC)
            handle.seek(start + info.compress_size)
            if handle.read(4) == _DESCRIPTOR_SIGNATURE:
                os.pwrite(descriptor, packed, start + info.compress_size + 4)
        position += _CENTRAL_SIZE + sum(lengths)
