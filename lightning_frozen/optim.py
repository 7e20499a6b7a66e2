"""Stripping frozen parameters out of whatever ``configure_optimizers`` returned.

Everything here works on plain torch optimizers and LR schedulers, before DeepSpeed sees them, so
nothing is allocated for a frozen parameter: no gradient, no fp32 master copy, no optimizer state.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_frozen.errors import ForeignParametersError, SchedulerGroupsError, UnsupportedOffloadOptimizerError

# Keys under which torch and DeepSpeed schedulers keep a learning rate that a group can climb to.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr")
_SCHEDULER_PER_GROUP_LR_KEYS = ("base_lrs", "max_lrs", "min_lrs")
_SCHEDULER_SCALAR_LR_KEYS = ("eta_min",)
# Scheduler attributes that hold sub-schedulers (SequentialLR, ChainedScheduler) rather than per-group values.
_SUB_SCHEDULER_KEYS = ("_schedulers",)


@dataclass
class StripReport:
    """What :func:`prepare_optimizer` changed, for the notice and the summary."""

    stripped_params: int = 0
    stripped_numel: int = 0
    lr_zero_params: int = 0
    lr_zero_numel: int = 0
    dropped_groups: list[int] = field(default_factory=list)


def optimizer_params(optimizer: Optimizer) -> list[nn.Parameter]:
    """Every parameter of every group, in order, each once."""
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


def check_params_belong_to(module: nn.Module, optimizer: Optimizer) -> None:
    """Raise :class:`ForeignParametersError` if the optimizer holds a tensor that is not one of ``module``'s."""
    own = {id(p) for p in module.parameters()}
    foreign = [p for p in optimizer_params(optimizer) if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ForeignParametersError(
            f"{type(optimizer).__name__} returned by `configure_optimizers` holds {len(foreign)} tensor(s) that are"
            f" not parameters of the LightningModule (shapes {shapes}{', ...' if len(foreign) > 5 else ''})."
            " Build the optimizer from `self.parameters()` (or a subset of them) inside `configure_optimizers`."
        )


def _scheduler_chain(scheduler: Any) -> list[Any]:
    """The scheduler and, for SequentialLR / ChainedScheduler, every scheduler inside it."""
    if scheduler is None:
        return []
    chain = [scheduler]
    for key in _SUB_SCHEDULER_KEYS:
        for inner in getattr(scheduler, key, None) or []:
            chain.extend(_scheduler_chain(inner))
    return chain


def _group_can_leave_zero(group: dict, index: int, schedulers: Sequence[Any]) -> bool:
    """Whether any learning rate this group can reach during the run is non-zero."""
    if "lr" in group and group["lr"] is None:
        return True  # the optimizer sets its own step size (Adafactor's `relative_step`)
    if any(float(group.get(key, 0.0) or 0.0) != 0.0 for key in _GROUP_LR_KEYS):
        return True
    for scheduler in schedulers:
        for key in _SCHEDULER_PER_GROUP_LR_KEYS:
            values = getattr(scheduler, key, None)
            if isinstance(values, (list, tuple)) and index < len(values) and float(values[index]) != 0.0:
                return True
        for key in _SCHEDULER_SCALAR_LR_KEYS:
            if float(getattr(scheduler, key, 0.0) or 0.0) != 0.0:
                return True
    return False


def lr_zero_group_indices(optimizer: Optimizer, scheduler: Any = None) -> list[int]:
    """Indices of the groups whose learning rate stays 0 for the whole run: the old ``lr=0`` freezing workaround.

    A group counts only if its ``lr``, its scheduler base LR (``initial_lr``/``base_lrs``), any peak
    (``max_lr``/``max_lrs``) and any floor (``eta_min``/``min_lrs``) are all 0, so warm-up from 0 never counts.
    """
    schedulers = _scheduler_chain(scheduler)
    return [
        index
        for index, group in enumerate(optimizer.param_groups)
        if not _group_can_leave_zero(group, index, schedulers)
    ]


def freeze_lr_zero_groups(optimizer: Optimizer, scheduler: Any = None) -> list[nn.Parameter]:
    """Set ``requires_grad=False`` on the trainable params of groups whose learning rate is 0 all run.

    Returns the params it froze.
    """
    frozen: list[nn.Parameter] = []
    for index in lr_zero_group_indices(optimizer, scheduler):
        for param in optimizer.param_groups[index]["params"]:
            if param.requires_grad:
                param.requires_grad_(False)
                frozen.append(param)
    return frozen


# Attributes (beyond those of the base classes) that hold one value per param group, for each scheduler class, as
# torch 2.13's lr_scheduler.py and DeepSpeed 0.19's lr_schedules.py define them. Values a scheduler keeps inside the
# group dicts (OneCycleLR's max_lr/min_lr, momentum bounds) move with their group by themselves. Other list
# attributes are not per group, whatever their length (OneCycleLR._schedule_phases, SequentialLR._milestones).
_PER_GROUP_ATTRIBUTES: dict[type, tuple[str, ...]] = {
    torch.optim.lr_scheduler.LRScheduler: ("base_lrs", "_last_lr"),
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
# Keys a scheduler reads from every group dict: a group added mid-run must bring them
_GROUP_KEYS_READ: dict[type, tuple[str, ...]] = {
    torch.optim.lr_scheduler.OneCycleLR: ("initial_lr", "max_lr", "min_lr"),
}


@functools.cache
def _deepspeed_per_group_attributes() -> dict[type, tuple[str, ...]]:
    from deepspeed.runtime import lr_schedules

    return {
        lr_schedules.LRRangeTest: ("min_lr", "_last_lr"),
        lr_schedules.OneCycle: ("min_lrs", "max_lrs", "min_moms", "max_moms", "_last_lr"),
        lr_schedules.WarmupLR: ("min_lrs", "max_lrs", "delta_lrs", "_last_lr"),
        lr_schedules.WarmupDecayLR: (),
        lr_schedules.WarmupCosineLR: ("org_lrs", "_last_lr"),
    }


def _per_group_table() -> dict[type, tuple[str, ...]]:
    return {**_PER_GROUP_ATTRIBUTES, **_deepspeed_per_group_attributes()}


def _known_per_group_attributes(scheduler: Any) -> tuple[str, ...]:
    table = _per_group_table()
    return tuple(dict.fromkeys(name for cls in type(scheduler).__mro__ if cls in table for name in table[cls]))


def register_per_group_attributes(scheduler_class: type, *names: str) -> None:
    """Declare which attributes of ``scheduler_class`` hold one value per param group (besides those of the torch or
    DeepSpeed scheduler it subclasses), so that they follow the groups kept when fully frozen groups are dropped."""
    _PER_GROUP_ATTRIBUTES[scheduler_class] = tuple(names)


def per_group_attributes(scheduler: Any, num_groups: int) -> tuple[str, ...]:
    """The names of ``scheduler``'s attributes that hold one value for each of its optimizer's ``num_groups`` param
    groups, from its class and base classes.

    Raises:
        SchedulerGroupsError: the class (or a subclass of a known one) is not known and has list attributes as long
            as the group count, which may be per group or not; see :func:`register_per_group_attributes`.
    """
    table = _per_group_table()
    names = _known_per_group_attributes(scheduler)
    if type(scheduler) in table:
        return names
    unsure = sorted(
        key
        for key, value in vars(scheduler).items()
        if key not in names and isinstance(value, (list, tuple)) and len(value) == num_groups
    )
    if unsure:
        raise SchedulerGroupsError(
            f"`{type(scheduler).__name__}` has list attributes as long as the {num_groups} param groups"
            f" ({', '.join(f'`{k}`' for k in unsure)}), and lightning-frozen does not know whether they hold one value"
            " per group, which must follow the groups it drops (fully frozen) or adds (finetuning callbacks). Declare"
            " the per-group ones with `lightning_frozen.optim.register_per_group_attributes("
            f"{type(scheduler).__name__}, 'name', ...)` (no names if none is), or build the optimizer from trainable"
            " params only, so that no group is dropped."
        )
    return names


def _filter_scheduler_groups(scheduler: Any, keep: list[int], num_groups: int) -> None:
    """Keep only the entries of ``keep`` in every per-group attribute of the scheduler and the ones inside it."""
    for inner in _scheduler_chain(scheduler):
        for key in per_group_attributes(inner, num_groups):
            value = getattr(inner, key, None)
            if isinstance(value, (list, tuple)) and len(value) == num_groups:
                setattr(inner, key, type(value)(value[i] for i in keep))


def strip_frozen_params(optimizer: Optimizer, scheduler: Any = None) -> StripReport:
    """Remove every ``requires_grad=False`` param from every group, in place; drop groups left empty.

    Per-group hyper-parameters stay with their group. Per-group attributes of the LR scheduler (``base_lrs``,
    ``lr_lambdas``, ``_last_lr``, ...; see :func:`per_group_attributes`) are filtered the same way, so each kept group
    gets exactly the learning rates it would get with the frozen groups left in.

    Raises:
        SchedulerGroupsError: groups are dropped and the scheduler is of a class whose per-group attributes are not
            known.
    """
    report = StripReport()
    num_groups = len(optimizer.param_groups)
    kept_groups: list[dict] = []
    keep: list[int] = []
    for index, group in enumerate(optimizer.param_groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        for param in group["params"]:
            if not param.requires_grad:
                report.stripped_params += 1
                report.stripped_numel += param.numel()
                optimizer.state.pop(param, None)
        if trainable:
            group["params"] = trainable
            kept_groups.append(group)
            keep.append(index)
        else:
            report.dropped_groups.append(index)
    optimizer.param_groups[:] = kept_groups
    # with every group dropped nothing trains, and the caller says so; the scheduler is moot
    if report.dropped_groups and kept_groups:
        _filter_scheduler_groups(scheduler, keep, num_groups)
    return report


def prepare_optimizer(
    module: nn.Module, optimizer: Optimizer, scheduler: Any = None, convert_lr_zero: bool = True
) -> StripReport:
    """Validate the optimizer against ``module``, freeze ``lr=0`` groups if asked, and strip frozen params.

    Raises:
        ForeignParametersError: the optimizer holds tensors that are not parameters of ``module``.
    """
    check_params_belong_to(module, optimizer)
    converted = freeze_lr_zero_groups(optimizer, scheduler) if convert_lr_zero else []
    report = strip_frozen_params(optimizer, scheduler)
    report.lr_zero_params = len(converted)
    report.lr_zero_numel = sum(p.numel() for p in converted)
    return report


def ungrouped_trainable_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """Names of ``module``'s trainable params that no group of ``optimizer`` holds.

    Plain torch computes their gradients and never steps them, e.g. the BatchNorm params of a frozen backbone that
    ``BackboneFinetuning(train_bn=True)`` keeps trainable while ``configure_optimizers`` names only the head.
    """
    grouped = {id(p) for p in optimizer_params(optimizer)}
    return [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in grouped]


def discard_gradients(params: Sequence[nn.Parameter]) -> list[Any]:
    """Drop each param's gradient as soon as autograd has accumulated it; returns the hook handles.

    A ZeRO-3 optimizer reduces and partitions the gradients of its own params only: one of another param would stay
    whole, stale, on every rank (and break the optimizer's ``zero_grad`` once a finetuning callback adds the param).
    """
    return [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def frozen_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if not p.requires_grad]


def to_cpu_adam(optimizer: Optimizer, scheduler: Any = None) -> Optimizer:
    """Swap a plain torch ``Adam``/``AdamW`` for DeepSpeed's CPU Adam with the same groups and hyper-parameters.

    ZeRO-Offload steps the optimizer on the CPU, where DeepSpeed refuses torch's own Adam. The scheduler, if
    given, is re-pointed at the new optimizer.

    Raises:
        UnsupportedOffloadOptimizerError: any other optimizer class, or ``amsgrad=True``.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or any(
        g.get("amsgrad") for g in optimizer.param_groups
    ):
        raise UnsupportedOffloadOptimizerError(
            f"Optimizer offload (`offload_optimizer=True`) steps on the CPU with DeepSpeed's CPU Adam, and"
            f" `{type(optimizer).__name__}` cannot be converted to it. Return `torch.optim.Adam`/`AdamW`"
            " (without amsgrad) or `deepspeed.ops.adam.DeepSpeedCPUAdam` from `configure_optimizers`, or set"
            " `offload_optimizer=False`."
        )
    adamw = isinstance(optimizer, torch.optim.AdamW)
    groups = [
        {
            key: value
            for key, value in group.items()
            if key
            not in ("foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad", "decoupled_weight_decay")
        }
        for group in optimizer.param_groups
    ]
    converted = DeepSpeedCPUAdam(groups, adamw_mode=adamw, **_cpu_adam_defaults(optimizer.defaults))
    for scheduler_ in _scheduler_chain(scheduler):
        scheduler_.optimizer = converted
    return converted


def _cpu_adam_defaults(defaults: dict) -> dict:
    return {key: defaults[key] for key in ("lr", "betas", "eps", "weight_decay") if key in defaults}


def optimizer_state_bytes_per_param(optimizer: Optional[Optimizer]) -> int:
    """Bytes of optimizer state each trainable element holds, besides its fp32 master copy."""
    if optimizer is None:
        return 8
    name = type(optimizer).__name__.lower()
    if "adam" in name or "lamb" in name:
        return 8
    if "sgd" in name:
        return 4 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    if "adagrad" in name or "rmsprop" in name:
        return 4
    return 8


def same_kind_of_optimizer(optimizer: Optimizer, param_groups: list[dict]) -> Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults over ``param_groups`` (each with its own values)."""
    import inspect

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return DeepSpeedCPUAdam(
            param_groups, adamw_mode=optimizer.adam_w_mode, **_cpu_adam_defaults(optimizer.defaults)
        )
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return type(optimizer)(param_groups, **defaults)


def regroup_scheduler(scheduler: Any, optimizer: Optimizer, kept: list[int], num_groups: int) -> None:
    """Point the scheduler at a rebuilt optimizer whose groups are old groups ``kept`` followed by new ones.

    Per-group attributes keep the entries of the kept groups. A new group gets its own ``initial_lr`` (default: its
    ``lr``) as base LR and ``lr`` as last LR; any other per-group value (a lambda, ``max_lr``, ``min_lr``, momentum
    bounds) it gets only where every existing group shares one.

    Raises:
        SchedulerGroupsError: a new group would need a per-group value the existing groups do not share, or lacks a
            key the scheduler reads from every group (OneCycleLR's ``initial_lr``/``max_lr``/``min_lr``).
    """
    added = optimizer.param_groups[len(kept) :]
    chain = _scheduler_chain(scheduler)
    for inner in chain:
        _check_added_groups_have_keys(inner, added)
    for group in added:
        group.setdefault("initial_lr", group["lr"])
    _filter_scheduler_groups(scheduler, kept, num_groups)
    for inner in chain:
        inner.optimizer = optimizer
        if not added:
            continue
        for key in _known_per_group_attributes(inner):
            values = getattr(inner, key, None)
            if isinstance(values, (list, tuple)):
                new = [_value_for_new_group(inner, key, values, group) for group in added]
                setattr(inner, key, type(values)([*values, *new]))


def _check_added_groups_have_keys(scheduler: Any, added: list[dict]) -> None:
    wanted = [key for cls, keys in _GROUP_KEYS_READ.items() if isinstance(scheduler, cls) for key in keys]
    if getattr(scheduler, "cycle_momentum", False) and isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        wanted += ["max_momentum", "base_momentum"]
    missing = sorted({key for group in added for key in wanted if key not in group})
    if missing:
        raise SchedulerGroupsError(
            f"`{type(scheduler).__name__}` reads {', '.join(f'`{k}`' for k in missing)} from every param group, and a"
            " group added mid-run has none. Put them in the group your `finetune_function` passes to"
            " `optimizer.add_param_group`, or use a scheduler that keeps no values in the groups (e.g. LambdaLR)."
        )


def _value_for_new_group(scheduler: Any, key: str, values: Sequence[Any], group: dict) -> Any:
    if key == "_last_lr":
        return group["lr"]
    if key in ("base_lrs", "org_lrs"):
        return group["initial_lr"]
    if values and all(v is values[0] or v == values[0] for v in values):
        return values[0]
    raise SchedulerGroupsError(
        f"`{type(scheduler).__name__}` has a different `{key}` for each param group, so a group added mid-run has"
        f" none. Give every group the same one (one lambda, or a scalar `{key.rstrip('s')}`), or use a scheduler"
        " without per-group values."
    )
