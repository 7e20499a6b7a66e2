"""The safetensors format, read and written here alone: a folder's tensors found one way (:class:`FolderIndex`: its
files, their headers, the order the bytes lie in) for the sliced loader and the merged export alike, where a tensor's
values lie (:class:`TensorSource`), and the header a written file starts with (:func:`header_bytes`).

Each rank's flat slices are read by positioned reads one tensor ahead of the loader: a thread reads the next slice with
``os.preadv`` (which releases the GIL) straight into a tensor while the loader checksums and encodes the one before,
and the file's pages are never mapped into the process (docs/internals.md has the figures). The byte offsets come from
the file's header, whose layout the safetensors format fixes; its Python API does not expose them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from lightning_frozen.errors import BaseFolderError, FrozenBaseFileError

# safetensors' dtype names, as torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LENGTH_BYTES = 8
# a tensor's fields in the safetensors header (the file format's names, not our checkpoint's keys)
_DTYPE_FIELD, _SHAPE_FIELD, _OFFSETS_FIELD = "dtype", "shape", "data_offsets"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes lie in its safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file
    nbytes: int


def read_header(path: str, every: bool = False) -> Optional[dict[str, StoredTensor]]:
    """The tensors of the safetensors file at ``path`` whose dtype torch has, by key; with ``every``, None where one
    has a dtype torch lacks.

    Raises:
        FrozenBaseFileError: the header is cut short or malformed, or the file ends before a tensor's bytes do.
    """
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(_HEADER_LENGTH_BYTES))
            if length > _MAX_HEADER_BYTES:
                raise FrozenBaseFileError(path, f"its header cannot be read: a header of {length} bytes")
            header = json.loads(file.read(length))
            size = os.fstat(file.fileno()).st_size
    except (struct.error, ValueError) as error:  # json's JSONDecodeError is a ValueError
        raise FrozenBaseFileError(path, f"its header cannot be read: {error}") from error
    data_start = _HEADER_LENGTH_BYTES + length
    stored = {}
    for key, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry.get(_DTYPE_FIELD)) if isinstance(entry, dict) else None
        if key == "__metadata__" or dtype is None and not every:
            continue
        if dtype is None:
            return None
        begin, end = entry[_OFFSETS_FIELD]
        if data_start + end > size:
            raise FrozenBaseFileError(path, f"the file ends at byte {size}, before tensor `{key}` does")
        stored[key] = StoredTensor(dtype, tuple(entry[_SHAPE_FIELD]), data_start + begin, end - begin)
    return stored


def header_bytes(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The start of a safetensors file holding ``tensors`` (name, dtype, shape), in that order: what precedes their
    bytes, laid end to end."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    for name, dtype, shape in tensors:
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {_DTYPE_FIELD: names[dtype], _SHAPE_FIELD: list(shape), _OFFSETS_FIELD: [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes, padding the header with spaces
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class SliceRead:
    """Elements ``[start, start + count)`` of the flattened tensor ``key`` of the safetensors file at ``path``."""

    path: str
    key: str
    start: int
    count: int


# one slice, or several read end to end into one tensor (of the first one's dtype)
Wanted = Union[SliceRead, Sequence[SliceRead]]


@dataclass(frozen=True)
class Run:
    """A tensor of the safetensors file at ``path`` that a model tensor holds whole, from its flat index ``start``."""

    path: str
    key: str
    start: int
    count: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorSource:
    """Where the values of a model tensor of ``shape`` lie in safetensors files: ``runs`` of file tensors laid end to
    end in its flat values (a plain tensor is one run; a MoE layer's fused experts are one run per expert tensor), or,
    with ``build``, file tensors read whole, in the order of ``runs``, that ``build`` turns into it (transformers'
    converter, where the layout is no runs)."""

    shape: tuple[int, ...]
    runs: tuple[Run, ...]
    build: Optional[Callable[[list[torch.Tensor]], torch.Tensor]] = None

    def reads(self, start: int, count: int) -> list[SliceRead]:
        """What to read, end to end, for the flat elements ``[start, start + count)``: the parts of the runs they
        overlap; with ``build``, every file tensor whole."""
        if self.build is not None:
            return [SliceRead(run.path, run.key, 0, run.count) for run in self.runs]
        parts = []
        for run in self.runs:
            first, end = max(start, run.start), min(start + count, run.start + run.count)
            if first < end:
                parts.append(SliceRead(run.path, run.key, first - run.start, end - first))
        return parts or [SliceRead(self.runs[0].path, self.runs[0].key, 0, 0)]

    def values(self, read: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """The flat elements ``[start, start + count)``, from ``read``: what :meth:`reads` gave, read end to end."""
        if self.build is None:
            return read
        parts = read.split([run.count for run in self.runs])
        built = self.build([part.view(run.shape) for part, run in zip(parts, self.runs)])
        return built.reshape(-1)[start : start + count]

    def read(self, start: int, count: int) -> torch.Tensor:
        """The flat elements ``[start, start + count)``, read now, in the files' dtype.

        Raises:
            FrozenBaseFileError: a file is cut short or its header malformed.
        """
        return self.values(read_slice(self.reads(start, count)), start, count)


class _Reader:
    """Positioned reads of slices, with one open descriptor and one parsed header per file."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[int, dict[str, StoredTensor]]] = {}

    def read(self, wanted: Wanted) -> torch.Tensor:
        parts = [wanted] if isinstance(wanted, SliceRead) else list(wanted)
        first = parts[0]
        dtype = self._open(first.path)[1][first.key].dtype
        # allocated as bytes: inside `zero.Init` (a gather in `configure_model`) a floating-point tensor constructor
        # casts to its dtype
        count = sum(part.count for part in parts)
        values = torch.empty(count * dtype.itemsize, dtype=torch.uint8).view(dtype)
        done = 0
        for part in parts:
            self._read_into(part, values[done : done + part.count])
            done += part.count
        return values

    def _read_into(self, wanted: SliceRead, out: torch.Tensor) -> None:
        descriptor, header = self._open(wanted.path)
        stored = header[wanted.key]
        if stored.dtype != out.dtype:  # a part of another dtype than the first: read, then cast
            out.copy_(self.read(wanted))
            return
        if wanted.count == 0:
            return
        item = out.element_size()
        assert wanted.start >= 0 and (wanted.start + wanted.count) * item <= stored.nbytes, wanted
        buffer = memoryview(out.view(torch.uint8).numpy())
        position, done = stored.offset + wanted.start * item, 0
        while done < len(buffer):
            got = os.preadv(descriptor, [buffer[done:]], position + done)
            if got == 0:
                raise FrozenBaseFileError(wanted.path, f"it ended while tensor `{wanted.key}` was being read")
            done += got

    def _open(self, path: str) -> tuple[int, dict[str, StoredTensor]]:
        if path not in self._files:
            header = read_header(path)
            descriptor = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # a larger read-ahead window; a hint only
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._files[path] = (descriptor, header)
        return self._files[path]

    def close(self) -> None:
        for descriptor, _ in self._files.values():
            os.close(descriptor)
        self._files.clear()


def read_slice(wanted: Wanted) -> torch.Tensor:
    """One slice (or several, end to end), read now, as a tensor of the file's dtype.

    Raises:
        FrozenBaseFileError: the file is cut short or its header malformed.
    """
    with closing(_Reader()) as reader:
        return reader.read(wanted)


@contextmanager
def read_ahead(
    reads: Sequence[Wanted], then: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
) -> Iterator[Iterator[torch.Tensor]]:
    """The slices of ``reads`` in their order (a list of slices is read end to end into one), each a tensor of the
    file's dtype; while the caller works on one, a thread reads the next, and there gives what ``then(index, values)``
    makes of it (work that can run beside the caller's, such as a checksum), in order. Errors of a read
    (:class:`FrozenBaseFileError`) or of ``then`` are raised where its slice is taken. Leaving the block early closes
    the files after the read in flight ends."""
    reader, pool = _Reader(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-frozen-read")

    def read(index: int) -> torch.Tensor:
        values = reader.read(reads[index])
        return values if then is None else then(index, values)

    def slices() -> Iterator[torch.Tensor]:
        pending: Optional[Future] = pool.submit(read, 0) if reads else None
        for index in range(len(reads)):
            assert pending is not None
            values = pending.result()
            pending = pool.submit(read, index + 1) if index + 1 < len(reads) else None
            yield values

    try:
        yield slices()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        reader.close()


class FolderIndex:
    """The tensors of safetensors files by key: the file each lies in and where (``tensors``), from their headers, read
    once."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.tensors = {key: (path, at) for path in sorted(set(paths)) for key, at in read_header(path).items()}

    @classmethod
    def of_folder(cls, folder: Path) -> FolderIndex:
        """The index of a Hugging Face folder's weights (``model.safetensors``, or the shards its index names).

        Raises:
            BaseFolderError: the folder holds no safetensors weights.
        """
        if (folder / INDEX_NAME).exists():
            return cls(
                str(folder / name) for name in json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()
            )
        if (folder / WEIGHTS_NAME).exists():
            return cls([str(folder / WEIGHTS_NAME)])
        raise BaseFolderError(
            f"{folder} holds no safetensors weights (`{WEIGHTS_NAME}` or its index), the only ones read here. Save the"
            " base with `save_pretrained` (transformers writes safetensors) and pass it as `base=` (`--base` on the"
            " command line)."
        )

    def order(self, key: str) -> tuple[str, int]:
        """A sort key that reads files one after another, each from its start to its end."""
        path, at = self.tensors[key]
        return path, at.offset

    def source(
        self,
        shape: tuple[int, ...],
        starts: Sequence[tuple[str, int]],
        build: Optional[Callable[[list[torch.Tensor]], torch.Tensor]] = None,
    ) -> TensorSource:
        """The :class:`TensorSource` of a tensor of ``shape`` whose folder tensors lie from the flat indices ``starts``
        (key, start) on, or, with ``build``, are read whole and built into it."""
        runs = []
        for key, start in starts:
            path, at = self.tensors[key]
            runs.append(Run(path, key, start, math.prod(at.shape), at.shape))
        return TensorSource(shape, tuple(runs), build)
