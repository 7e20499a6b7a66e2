"""What ``configure_optimizers`` returned, made ready for ZeRO-3: checked, the ``lr=0`` workaround recognised.

The param groups stay as the user built them, frozen params included: DeepSpeed's ZeRO-3 optimizer leaves every
``requires_grad=False`` param out of its partitions, group by group, so nothing is allocated for a frozen param (no
gradient, no fp32 master copy, no optimizer state) and the LR scheduler acts on the groups it was built over. What
DeepSpeed cannot recognise is a group frozen by a learning rate of 0 for the whole run: its params are frozen here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_frozen.capabilities import SCHEDULER_INTERNALS, available
from lightning_frozen.errors import (
    ForeignParametersError,
    NoTrainableParametersError,
    UnsupportedOffloadOptimizerError,
    format_names,
)
from lightning_frozen.zero.optimizers import (
    cpu_adam,
    cpu_adam_is_adamw,
    is_cpu_adam,
    point_schedulers_at,
    scheduler_chain,
)
from lightning_frozen.zero.params import check_has_trainable

# Keys under which torch and DeepSpeed schedulers keep a learning rate that a group can climb to.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr")
_SCHEDULER_PER_GROUP_LR_KEYS = ("base_lrs", "max_lrs", "min_lrs", "org_lrs")  # org_lrs: DeepSpeed's WarmupCosineLR
_SCHEDULER_SCALAR_LR_KEYS = ("eta_min",)


def optimizer_params(optimizer: Optimizer) -> list[nn.Parameter]:
    """Every parameter of every group, in order, each once."""
    return list({id(param): param for group in optimizer.param_groups for param in group["params"]}.values())


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


def _group_can_leave_zero(group: dict, index: int, schedulers: Sequence[Any]) -> bool:
    """Whether any learning rate this group can reach during the run is non-zero."""
    if "lr" in group and group["lr"] is None:
        return True  # the optimizer sets its own step size (Adafactor's `relative_step`)
    if any(float(group.get(key, 0.0) or 0.0) != 0.0 for key in _GROUP_LR_KEYS):
        return True
    if schedulers and not available(SCHEDULER_INTERNALS):
        return True  # what the scheduler climbs to cannot be read: the group is kept, as without this package
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
    schedulers = scheduler_chain(scheduler)
    return [
        index
        for index, group in enumerate(optimizer.param_groups)
        if not _group_can_leave_zero(group, index, schedulers)
    ]


def freeze_lr_zero_groups(optimizer: Optimizer, scheduler: Any = None) -> list[nn.Parameter]:
    """Set ``requires_grad=False`` on the trainable params of groups whose learning rate is 0 all run; return them."""
    frozen: list[nn.Parameter] = []
    for index in lr_zero_group_indices(optimizer, scheduler):
        for param in optimizer.param_groups[index]["params"]:
            if param.requires_grad:
                param.requires_grad_(False)
                frozen.append(param)
    return frozen


def prepare_for_zero(
    module: nn.Module, optimizer: Optimizer, scheduler: Any, convert_lr_zero: bool, strategy_name: str
) -> Optimizer:
    """Check the optimizer against ``module`` and freeze ``lr=0`` groups if asked (:func:`freeze_lr_zero_groups`),
    with the notices a run gets: ``lr=0`` groups frozen, nothing frozen at all. The groups are left as they are.

    Raises:
        ForeignParametersError: the optimizer holds tensors that are not parameters of ``module``.
        NoTrainableParametersError: nothing trainable in the module or in the optimizer.
    """
    check_params_belong_to(module, optimizer)
    converted = freeze_lr_zero_groups(optimizer, scheduler) if convert_lr_zero else []
    if converted:
        rank_zero_info(
            f"lightning-frozen: froze {len(converted)} parameter tensors ({sum(p.numel() for p in converted):,}"
            " elements) whose learning rate is 0 for the whole run (the `lr=0` workaround); they get no gradient or"
            " optimizer state. Pass `convert_lr_zero_groups=False` to keep them in the optimizer."
        )
    check_has_trainable(module)
    if not frozen_params(module):
        rank_zero_warn(
            f"lightning-frozen: every parameter of `{type(module).__name__}` is trainable, so"
            f" {strategy_name} brings nothing over plain ZeRO-3 (it saves optimizer state, gradients and"
            " checkpoint size of frozen parameters only). Freeze the base before `fit` (`requires_grad_(False)`,"
            " or wrap the model with PEFT), or train with `strategy='deepspeed_stage_3'`."
        )
    if not any(p.requires_grad for p in optimizer_params(optimizer)):
        raise NoTrainableParametersError(
            f"The {type(optimizer).__name__} returned by `configure_optimizers` holds only frozen parameters"
            " (`requires_grad=False`), so nothing would train. Pass the trainable parameters to it, e.g."
            " `[p for p in self.parameters() if p.requires_grad]`."
        )
    return optimizer


def ungrouped_trainable_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """Names of ``module``'s trainable params that no group of ``optimizer`` holds (``train_bn=True``'s BatchNorm)."""
    grouped = {id(p) for p in optimizer_params(optimizer)}
    return [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in grouped]


def leave_ungrouped_unstepped(
    module: nn.Module, optimizer: Optimizer, previous_names: list[str], previous_hooks: list[Any]
) -> tuple[list[str], list[Any]]:
    """Trainable params outside every group train as in plain torch: never stepped. ZeRO-3 would keep their whole
    gradients forever, so they are dropped as they come. Replaces ``previous_hooks``; returns the names and hooks,
    with a notice when the names changed."""
    for handle in previous_hooks:
        handle.remove()
    names = ungrouped_trainable_names(module, optimizer)
    params = dict(module.named_parameters())
    hooks = discard_gradients([params[n] for n in names])
    if names and names != previous_names:
        rank_zero_info(
            f"lightning-frozen: {format_names(names)} require grad but are in no optimizer param group, so they"
            " are never stepped (as in plain PyTorch); a finetuning callback may add them to a group later."
        )
    return names, hooks


def discard_gradients(params: Sequence[nn.Parameter]) -> list[Any]:
    """Drop each param's gradient as soon as autograd has accumulated it; returns the hook handles."""
    return [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def frozen_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if not p.requires_grad]


def to_cpu_adam(optimizer: Optimizer, scheduler: Any = None) -> Optimizer:
    """Swap a plain torch ``Adam``/``AdamW`` for DeepSpeed's CPU Adam (ZeRO-Offload refuses torch's) with the same
    groups and hyper-parameters; ``scheduler``, if given, is pointed at it.

    Raises:
        UnsupportedOffloadOptimizerError: any other optimizer class, or ``amsgrad=True``.
    """
    if is_cpu_adam(optimizer):
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
    converted = cpu_adam(groups, adamw, _cpu_adam_defaults(optimizer.defaults))
    point_schedulers_at(scheduler, converted)
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

    if is_cpu_adam(optimizer):
        return cpu_adam(param_groups, cpu_adam_is_adamw(optimizer), _cpu_adam_defaults(optimizer.defaults))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return type(optimizer)(param_groups, **defaults)
