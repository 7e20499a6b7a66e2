"""DeepSpeed's optimizer side, as the rest of the package meets it: its CPU Adam (what ZeRO-Offload steps with), the
torch optimizer inside a ZeRO optimizer, the step counters an engine keeps, and the schedulers inside torch's
``SequentialLR`` / ``ChainedScheduler`` (a private name). The ZeRO-3 optimizer's partitions and state are
``params.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_frozen.capabilities import SCHEDULER_INTERNALS, available

# what a DeepSpeed engine counts (steps, samples, micro-steps, fp16 overflows skipped), carried to a rebuilt engine
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
# Attributes that hold sub-schedulers (SequentialLR, ChainedScheduler): each follows the optimizer it is pointed at
SUB_SCHEDULER_KEYS = ("_schedulers",)


def is_cpu_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's CPU Adam (``deepspeed.ops.adam.DeepSpeedCPUAdam``)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return isinstance(optimizer, DeepSpeedCPUAdam)


def cpu_adam(param_groups: list[dict[str, Any]], adamw: bool, defaults: Mapping[str, Any]) -> Optimizer:
    """DeepSpeed's CPU Adam over ``param_groups``: AdamW (decoupled weight decay) when ``adamw``, else Adam, with the
    ``defaults`` (``lr``, ``betas``, ``eps``, ``weight_decay``) for what a group leaves out. Its ``cpu_adam`` extension
    is compiled on first use, then cached."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(param_groups, adamw_mode=adamw, **defaults)


def cpu_adam_is_adamw(optimizer: Any) -> bool:
    """Whether a CPU Adam (:func:`is_cpu_adam`) decouples weight decay (AdamW)."""
    return bool(optimizer.adam_w_mode)


def inner_optimizer(deepspeed_optimizer: Any) -> Any:
    """The torch optimizer a ZeRO optimizer steps with (what ``configure_optimizers`` returned);
    ``deepspeed_optimizer`` itself when it wraps none."""
    return getattr(deepspeed_optimizer, "optimizer", deepspeed_optimizer)


def engine_counters(engine: Any) -> dict[str, Any]:
    """The step counters of a DeepSpeed ``engine`` (:data:`ENGINE_COUNTERS`), to carry to another engine."""
    return {key: getattr(engine, key) for key in ENGINE_COUNTERS}


def set_engine_counters(engine: Any, counters: Mapping[str, Any]) -> None:
    """Give ``engine`` the step counters :func:`engine_counters` took from another one."""
    for key, value in counters.items():
        setattr(engine, key, value)


def scheduler_chain(scheduler: Any) -> list[Any]:
    """The scheduler and, for SequentialLR / ChainedScheduler, every scheduler inside it (the outermost alone where
    ``capabilities.SCHEDULER_INTERNALS`` is off)."""
    if scheduler is None:
        return []
    chain = [scheduler]
    for key in SUB_SCHEDULER_KEYS if available(SCHEDULER_INTERNALS) else ():
        for inner in getattr(scheduler, key, None) or []:
            chain.extend(scheduler_chain(inner))
    return chain


def point_schedulers_at(scheduler: Any, optimizer: Optimizer) -> None:
    """Point ``scheduler`` and every scheduler inside it at ``optimizer`` (one with the same param groups, in the
    same order, and maybe more), as a scheduler of the old one would act on groups added to it."""
    for inner in scheduler_chain(scheduler):
        inner.optimizer = optimizer


def keep_empty_groups(optimizer: Optimizer, dtype: torch.dtype) -> None:
    """Give each param group without params one zero-element frozen param of ``dtype`` (ZeRO-3 reads its own from
    group 0's first param), so DeepSpeed's engine keeps the group and its index (docs/internals.md)."""
    for group in optimizer.param_groups:
        if not group["params"]:
            group["params"] = [nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)]
