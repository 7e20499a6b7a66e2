"""The merged export's plan and its one pass. The plan is built once from the parts ``hf/merging.py`` describes: its
steps in the order the base folder's files lie, each with what to read (slices of the folder's tensors), what to count
for the fingerprint and what to write, and the shards the written tensors go in. The pass runs it, each step reading
only its own pieces (a thread reads, builds and checksums the next while this one merges), writing its tensors into
the shards as they come, then verifying what it read against the fingerprint."""

from __future__ import annotations

import functools
import json
import math
import os
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_frozen.base import slice_reads
from lightning_frozen.base.fingerprint import ReadSums, fingerprint_base, verify_base
from lightning_frozen.base.slice_reads import WEIGHTS_NAME, FolderIndex, TensorSource
from lightning_frozen.format import layout
from lightning_frozen.format.merged_parts import MergedParts, Part, Read, Written
from lightning_frozen.progress import Progress
from lightning_frozen.zero.frozen_compute import KERNELS

# elements read, checksummed, cast and written at a time for a tensor that is copied through (16 MiB in bf16)
CHUNK_ELEMENTS = 1 << 23
# bytes a shard is written between two flushes to disk
SYNC_EVERY_BYTES = 256 << 20


@dataclass(frozen=True)
class Piece:
    """Flat elements ``[start, start + count)`` of the tensor ``source`` gives, read for ``read``; counted in the
    fingerprint ``record`` (a stand-in of the recorded dtype) from ``start``, if any; streamed into ``written``, where
    the part does not merge."""

    source: TensorSource
    start: int
    count: int
    read: Read
    record: Optional[torch.Tensor]
    written: Optional[Written] = None


@dataclass
class MergePlan:
    """The steps of the pass, each a part of the merged model and the pieces read for it in order (its reads whole,
    for a merge; else each folder tensor of its reads, in chunks); the shards (file name, tensors); and the
    fingerprint records the reads are verified against: ``recorded`` (the fingerprint, of the tensors read here),
    their ``stand_ins`` by name, the ``sums``."""

    steps: list[tuple[Part, list[Piece]]]
    shards: list[tuple[str, list[Written]]]
    recorded: dict[str, Any]
    stand_ins: list[tuple[str, torch.Tensor]]
    sums: ReadSums


def merge_plan(
    merged: MergedParts, index: FolderIndex, checkpoint: Mapping[str, Any], lead: str, limit: int
) -> MergePlan:
    """The plan of ``merged`` over the folder ``index``: each tensor the fingerprint of ``checkpoint`` records under
    ``lead`` (the PEFT model's name in the module) counted at the first read of it; shards of at most
    ``limit`` bytes."""
    fingerprint = layout.fingerprint_of(checkpoint)
    records = {name: r for name, r in layout.fingerprint_tensors(fingerprint).items() if name.startswith(lead)}
    by_name = {name[len(lead) :]: name for name in records}
    verified: dict[str, Any] = {}
    stand_ins: list[tuple[str, torch.Tensor]] = []
    steps = []
    for part in merged.parts:
        pieces, outputs = [], iter(part.written)
        for read in part.reads:
            source = index.source(read.shape, read.starts, read.build)
            name = next((by_name.pop(n) for n in read.names if n in by_name), None)
            record = None
            if name is not None:
                shape, dtype = records[name][layout.SHAPE], getattr(torch, records[name][layout.DTYPE])
                record = torch.empty(shape, dtype=dtype, device="meta")
                stand_ins.append((name, record))
                verified[name] = records[name]
            if part.merge is not None:
                pieces.append(Piece(source, 0, math.prod(read.shape), read, record))
                continue
            for run in source.runs:
                written, end = next(outputs), run.start + run.count
                starts = list(range(run.start, end, CHUNK_ELEMENTS)) or [run.start]
                pieces += [Piece(source, s, min(CHUNK_ELEMENTS, end - s), read, record, written) for s in starts]
        steps.append((part, pieces))
    # trained tensors alone after every read
    steps.sort(key=lambda step: index.order(step[1][0].source.runs[0].key) if step[1] else ("\uffff", 0))
    recorded = {**fingerprint, layout.DIGEST: None, layout.TENSORS: verified}  # compared tensor by tensor
    sums = ReadSums(fingerprint.get(layout.FINGERPRINT_MODE, "none"), KERNELS)
    shards = _shards([t for part, _ in steps for t in part.written], limit)
    return MergePlan(steps, shards, recorded, stand_ins, sums)


def _shards(tensors: list[Written], limit: int) -> list[tuple[str, list[Written]]]:
    """``tensors`` in shards of at most ``limit`` bytes (a larger tensor alone), named as ``save_pretrained`` names
    them."""
    shards: list[list[Written]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    if len(shards) == 1:
        return [(WEIGHTS_NAME, shards[0])]
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", s) for i, s in enumerate(shards)]


def write_merged(
    merged: MergedParts,
    index: FolderIndex,
    checkpoint: Mapping[str, Any],
    source: str,
    lead: str,
    limit: int,
    folder: Path,
    write_ahead: int,
) -> None:
    """The :func:`merge_plan` of ``merged`` run: each step's pieces read (and counted in its sums), merged where the
    part merges, written into the shards in ``folder`` (with their index where there are several); at most
    ``write_ahead`` bytes (or one tensor) are handed to the writing thread and not yet written. What was read is then
    verified against the fingerprint of ``checkpoint`` (at ``source``).

    Raises:
        FrozenBaseMismatchError: the base folder's tensors are not those the checkpoint was trained on.
    """
    plan = merge_plan(merged, index, checkpoint, lead, limit)
    pieces = [piece for _, step in plan.steps for piece in step]

    def taken(at: int, read: torch.Tensor) -> torch.Tensor:  # on the reading thread, beside the merge
        piece = pieces[at]
        values = piece.source.values(read, piece.start, piece.count)
        if piece.record is not None:
            plan.sums.add(piece.record, values.to(piece.record.dtype), piece.start)
        return values

    total = sum(t.nbytes for _, shard in plan.shards for t in shard)
    writer = _ShardWriter(folder, plan.shards, Progress(total), write_ahead)
    reads = [piece.source.reads(piece.start, piece.count) for piece in pieces]
    try:
        with torch.no_grad(), slice_reads.read_ahead(reads, taken) as slices:
            for part, step in plan.steps:
                if part.merge is not None:
                    merged = part.merge([next(slices).to(p.read.dtype).reshape(p.read.shape) for p in step])
                    for tensor in part.written:
                        writer.write(tensor, merged.pop(tensor.name))
                    continue
                for piece in step:
                    values, read = next(slices), piece.read
                    if read.delta is not None:  # PEFT's delta of its expert added, in the converted tensor's dtype
                        values = values.to(read.dtype) + read.delta(piece.start, piece.count).to(read.dtype)
                    assert piece.written is not None
                    writer.write(piece.written, values)
    finally:
        writer.close()
    verify_base(
        plan.recorded,
        plan.stand_ins,
        layout.reference_of(checkpoint),
        source,
        functools.partial(fingerprint_base, loaded=plan.sums),
        if_intended="merge with PEFT itself (`export_peft_adapter`, then PEFT's `merge_and_unload`)",
    )
    if len(plan.shards) > 1:
        weight_map = {t.name: name for name, shard in plan.shards for t in shard}
        shards = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / slice_reads.INDEX_NAME).write_text(json.dumps(shards, indent=2, sort_keys=True) + "\n")


class _ShardWriter:
    """The shards, each written as its tensors come in the planned order: its header first, then each tensor's bytes.

    A thread writes while the caller merges the next layer, holding at most ``write_ahead`` bytes (or one tensor) not
    yet written, and flushes each shard to disk every ``SYNC_EVERY_BYTES``, so that the disk writes as the pass goes
    instead of all at the final fsync."""

    def __init__(
        self, folder: Path, shards: list[tuple[str, list[Written]]], progress: Progress, write_ahead: int
    ) -> None:
        self._order = [
            (folder / name if i == 0 else None, tensors, t) for name, tensors in shards for i, t in enumerate(tensors)
        ]
        self._order.reverse()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-frozen-write")
        self._pending: deque[tuple[Future, int]] = deque()
        self._file: Optional[IO[bytes]] = None
        self._unsynced = 0
        self._current: Optional[Written] = None
        self._left = 0
        self._progress = progress
        self._write_ahead = write_ahead

    def write(self, tensor: Written, values: torch.Tensor) -> None:
        """Append ``values``: the next elements of ``tensor``, cast to its dtype."""
        if self._left == 0:
            path, tensors, self._current = self._order.pop()
            if path is not None:
                header = slice_reads.header_bytes((t.name, t.dtype, t.shape) for t in tensors)
                self._submit(functools.partial(self._open, path, header), 0)
            self._left = self._current.nbytes
        data = values.to(tensor.dtype).contiguous().reshape(-1).view(torch.uint8)
        assert self._current is not None and self._current.name == tensor.name and data.numel() <= self._left, tensor
        self._submit(functools.partial(self._append, data), data.numel())
        self._left -= data.numel()
        if self._left == 0 and self._progress.advance(self._current.nbytes):
            status = self._progress.status("MiB", 2**20)
            rank_zero_info(f"lightning-frozen: writing the merged model: {self._progress.items} tensors, {status}")

    def close(self) -> None:
        """Wait for every write, close the last shard; raise what a write raised."""
        try:
            self._submit(self._close, 0)
            while self._pending:
                self._pending.popleft()[0].result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, work: Callable[[], None], nbytes: int) -> None:
        self._pending.append((self._pool.submit(work), nbytes))
        while len(self._pending) > 1 and sum(n for _, n in self._pending) > self._write_ahead:
            self._pending.popleft()[0].result()
        while self._pending and self._pending[0][0].done():
            self._pending.popleft()[0].result()

    def _open(self, path: Path, header: bytes) -> None:
        self._close()
        self._file = open(path, "wb")  # noqa: SIM115  (open across the writes of its tensors, closed by _close)
        self._file.write(header)

    def _append(self, data: torch.Tensor) -> None:
        assert self._file is not None
        self._file.write(data.numpy())
        self._unsynced += data.numel()
        if self._unsynced >= SYNC_EVERY_BYTES:
            self._file.flush()
            os.fdatasync(self._file.fileno())
            self._unsynced = 0

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
