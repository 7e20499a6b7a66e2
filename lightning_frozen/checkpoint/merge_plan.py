"""The merged export's plan, built once from the parts ``hf/merging.py`` describes: its steps in the order the base
folder's files lie, each with what to read (slices of the folder's tensors), what to count for the fingerprint and
what to write, and the shards the written tensors go in. ``checkpoint/merge_writer.py`` runs it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_frozen.base.fingerprint import ReadSums
from lightning_frozen.base.slice_reads import WEIGHTS_NAME, FolderIndex, TensorSource
from lightning_frozen.format import layout
from lightning_frozen.format.merged_parts import MergedParts, Part, Read, Written
from lightning_frozen.zero.frozen_compute import KERNELS

# elements read, checksummed, cast and written at a time for a tensor that is copied through (16 MiB in bf16)
CHUNK_ELEMENTS = 1 << 23


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


@dataclass(frozen=True)
class Step:
    """A part of the merged model and the pieces read for it, in order: its reads whole, for a merge; else each
    folder tensor of its reads, in chunks."""

    part: Part
    pieces: list[Piece]


@dataclass
class MergePlan:
    """The steps of the pass, the shards (file name, tensors), and the fingerprint records the reads are verified
    against: ``recorded`` (the fingerprint, of the tensors read here), their ``stand_ins`` by name, the ``sums``; the
    ``reference`` of the base and the checkpoint (``source``) they come from."""

    steps: list[Step]
    shards: list[tuple[str, list[Written]]]
    recorded: dict[str, Any]
    stand_ins: list[tuple[str, torch.Tensor]]
    sums: ReadSums
    reference: Optional[str]
    source: str


def merge_plan(
    merged: MergedParts, index: FolderIndex, checkpoint: Mapping[str, Any], source: str, lead: str, limit: int
) -> MergePlan:
    """The plan of ``merged`` over the folder ``index``: each tensor the fingerprint of ``checkpoint`` (at ``source``)
    records under ``lead`` (the PEFT model's name in the module) counted at the first read of it; shards of at most
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
        steps.append(Step(part, pieces))
    # trained tensors alone after every read
    steps.sort(key=lambda step: index.order(step.pieces[0].source.runs[0].key) if step.pieces else ("\uffff", 0))
    recorded = {**fingerprint, layout.DIGEST: None, layout.TENSORS: verified}  # compared tensor by tensor
    sums = ReadSums(fingerprint.get(layout.FINGERPRINT_MODE, "none"), KERNELS)
    shards = _shards([t for step in steps for t in step.part.written], limit)
    return MergePlan(steps, shards, recorded, stand_ins, sums, layout.reference_of(checkpoint), source)


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
