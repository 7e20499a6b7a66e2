"""The package's own collectives: the agreements its ranks reach (a flag any rank raised, a value from every rank),
beside ZeRO's gathers of params. One door for them, through ``deepspeed.comm``, whose process group the strategy
starts; on one rank, or before any process group, each returns this rank's own value."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch


def distributed() -> bool:
    """Whether this process is one of several ranks of DeepSpeed's process group (never importing DeepSpeed: without
    it imported there is none)."""
    dist = sys.modules.get("deepspeed.comm")
    return dist is not None and dist.is_initialized() and dist.get_world_size() > 1


def gather_objects(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (picklable values, any backend). Collective."""
    import deepspeed.comm as dist

    if not distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def any_rank(flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Per flag, whether any rank raised it: one ``all_reduce`` of ``len(flags)`` integers on ``device`` (the
    backend's device: CUDA under NCCL). Collective."""
    import deepspeed.comm as dist

    raised = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    if distributed():
        dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return [bool(flag) for flag in raised.tolist()]
