"""The merged model as the merged export writes it, shape only: what ``hf/merging.py`` describes (each part PEFT's
``merge_and_unload`` leaves, what it reads from the base folder and what it writes) and ``checkpoint/merge_plan.py``
plans from, without either knowing the other."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class Written:
    """A tensor of the merged folder, as ``save_pretrained`` writes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Read:
    """A base tensor a part reads from the folder: its ``names`` in the adapted model (its fingerprint record's among
    them), its shape and the dtype the merge takes; ``starts``, each folder key with the flat index its values start at
    in it, or, with ``build``, the keys whose values transformers' converter turns into it. ``delta`` gives the flat
    elements ``[start, start + count)`` of PEFT's delta, within one expert, where the part streams the experts of a
    converted tensor."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    starts: tuple[tuple[str, int], ...]
    build: Optional[Callable[[list[torch.Tensor]], torch.Tensor]] = None
    delta: Optional[Callable[[int, int], torch.Tensor]] = None


@dataclass
class Part:
    """One part of the merged model: a tuner layer or wrapper merged whole, or one tensor. With ``merge``, its reads
    are taken whole and ``merge`` (PEFT's merge, the trained tensors inside, reverted as ``save_pretrained`` writes)
    gives ``written`` by name. Without it, the folder tensors of its reads are streamed into ``written``, one each in
    order (a tensor copied through; a MoE's experts, each folder tensor with its expert's delta added)."""

    written: list[Written]
    reads: list[Read] = field(default_factory=list)
    merge: Optional[Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]] = None


@dataclass
class MergedParts:
    """The parts of the merged model, the tied weights the adapter changed (which it holds untied), and what writes
    its config into a folder."""

    parts: list[Part]
    untied: list[str]
    write_config: Callable[[Path], None]
