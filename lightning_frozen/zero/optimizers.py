"""DeepSpeed's optimizer side, as the rest of the package meets it: its CPU Adam (what ZeRO-Offload steps with), the
torch optimizer inside a ZeRO optimizer, the step counters an engine keeps, and the per-group attributes of
torch's and DeepSpeed's LR schedulers (private names included). The ZeRO-3 optimizer's partitions and state are
``params.py``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

# what a DeepSpeed engine counts (steps, samples, micro-steps, fp16 overflows skipped), carried to a rebuilt engine
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
# A scheduler's last LRs, one per param group (torch's and DeepSpeed's schedulers alike)
LAST_LR = "_last_lr"
# Scheduler attributes that hold sub-schedulers (SequentialLR, ChainedScheduler) rather than per-group values.
SUB_SCHEDULER_KEYS = ("_schedulers",)

# Attributes (beyond those of the base classes) that hold one value per param group, for each scheduler class, as
# torch 2.13's lr_scheduler.py and DeepSpeed 0.19's lr_schedules.py define them. Values a scheduler keeps inside the
# group dicts (OneCycleLR's max_lr/min_lr, momentum bounds) move with their group by themselves. Other list
# attributes are not per group, whatever their length (OneCycleLR._schedule_phases, SequentialLR._milestones).
TORCH_PER_GROUP_ATTRIBUTES: dict[type, tuple[str, ...]] = {
    torch.optim.lr_scheduler.LRScheduler: ("base_lrs", LAST_LR),
    torch.optim.lr_scheduler.LambdaLR: ("lr_lambdas",),
    torch.optim.lr_scheduler.MultiplicativeLR: ("lr_lambdas",),
    torch.optim.lr_scheduler.StepLR: (),
    torch.optim.lr_scheduler.MultiStepLR: (),
    torch.optim.lr_scheduler.ConstantLR: (),
    torch.optim.lr_scheduler.LinearLR: (),
    torch.optim.lr_scheduler.ExponentialLR: (),
    torch.optim.lr_scheduler.PolynomialLR: (),
    torch.optim.lr_scheduler.CosineAnnealingLR: (),
    torch.optim.lr_scheduler.CosineAnnealingWarmRestarts: (),
    torch.optim.lr_scheduler.OneCycleLR: (),
    torch.optim.lr_scheduler.CyclicLR: ("max_lrs", "base_momentums", "max_momentums"),
    torch.optim.lr_scheduler.SequentialLR: (),
    torch.optim.lr_scheduler.ChainedScheduler: (),
    torch.optim.lr_scheduler.ReduceLROnPlateau: ("min_lrs",),
}


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
    """The torch optimizer a ZeRO optimizer steps with (what ``configure_optimizers`` returned, after stripping);
    ``deepspeed_optimizer`` itself when it wraps none."""
    return getattr(deepspeed_optimizer, "optimizer", deepspeed_optimizer)


def engine_counters(engine: Any) -> dict[str, Any]:
    """The step counters of a DeepSpeed ``engine`` (:data:`ENGINE_COUNTERS`), to carry to another engine."""
    return {key: getattr(engine, key) for key in ENGINE_COUNTERS}


def set_engine_counters(engine: Any, counters: Mapping[str, Any]) -> None:
    """Give ``engine`` the step counters :func:`engine_counters` took from another one."""
    for key, value in counters.items():
        setattr(engine, key, value)


@functools.cache
def scheduler_per_group_attributes() -> dict[type, tuple[str, ...]]:
    """For each of DeepSpeed 0.19's LR scheduler classes (``deepspeed.runtime.lr_schedules``), the attributes that
    hold one value per param group."""
    from deepspeed.runtime import lr_schedules

    return {
        lr_schedules.LRRangeTest: ("min_lr", "_last_lr"),
        lr_schedules.OneCycle: ("min_lrs", "max_lrs", "min_moms", "max_moms", "_last_lr"),
        lr_schedules.WarmupLR: ("min_lrs", "max_lrs", "delta_lrs", "_last_lr"),
        lr_schedules.WarmupDecayLR: (),
        lr_schedules.WarmupCosineLR: ("org_lrs", "_last_lr"),
    }
