"""LR schedulers that follow their optimizer's param groups when groups are dropped or added.

Stripping frozen params can drop whole groups, and a finetuning callback can add groups mid-run; every scheduler
attribute that holds one value per group (``base_lrs``, ``lr_lambdas``, the last LRs, ...) must follow, for torch's
and DeepSpeed's schedulers, those inside ``SequentialLR``/``ChainedScheduler``, and registered user classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_frozen.errors import SchedulerGroupsError
from lightning_frozen.zero.optimizers import (
    LAST_LR,
    SUB_SCHEDULER_KEYS,
    TORCH_PER_GROUP_ATTRIBUTES,
    scheduler_per_group_attributes,
)


def scheduler_chain(scheduler: Any) -> list[Any]:
    """The scheduler and, for SequentialLR / ChainedScheduler, every scheduler inside it."""
    if scheduler is None:
        return []
    chain = [scheduler]
    for key in SUB_SCHEDULER_KEYS:
        for inner in getattr(scheduler, key, None) or []:
            chain.extend(scheduler_chain(inner))
    return chain


# Keys a scheduler reads from every group dict: a group added mid-run must bring them
_GROUP_KEYS_READ: dict[type, tuple[str, ...]] = {
    torch.optim.lr_scheduler.OneCycleLR: ("initial_lr", "max_lr", "min_lr"),
}


# the user's scheduler classes, as :func:`register_per_group_attributes` declares them
_REGISTERED: dict[type, tuple[str, ...]] = {}


def _per_group_table() -> dict[type, tuple[str, ...]]:
    return {**TORCH_PER_GROUP_ATTRIBUTES, **scheduler_per_group_attributes(), **_REGISTERED}


def _known_per_group_attributes(scheduler: Any) -> tuple[str, ...]:
    table = _per_group_table()
    return tuple(dict.fromkeys(name for cls in type(scheduler).__mro__ if cls in table for name in table[cls]))


def register_per_group_attributes(scheduler_class: type, *names: str) -> None:
    """Declare which attributes of ``scheduler_class`` hold one value per param group (besides those of the torch or
    DeepSpeed scheduler it subclasses), so that they follow the groups kept when fully frozen groups are dropped."""
    _REGISTERED[scheduler_class] = tuple(names)


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
            " the per-group ones with `lightning_frozen.optim.schedulers.register_per_group_attributes("
            f"{type(scheduler).__name__}, 'name', ...)` (no names if none is), or build the optimizer from trainable"
            " params only, so that no group is dropped."
        )
    return names


def filter_scheduler_groups(scheduler: Any, keep: list[int], num_groups: int) -> None:
    """Keep only the entries of ``keep`` in every per-group attribute of the scheduler and the ones inside it."""
    for inner in scheduler_chain(scheduler):
        for key in per_group_attributes(inner, num_groups):
            value = getattr(inner, key, None)
            if isinstance(value, (list, tuple)) and len(value) == num_groups:
                setattr(inner, key, type(value)(value[i] for i in keep))


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
    chain = scheduler_chain(scheduler)
    for inner in chain:
        _check_added_groups_have_keys(inner, added)
    for group in added:
        group.setdefault("initial_lr", group["lr"])
    filter_scheduler_groups(scheduler, kept, num_groups)
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
    if key == LAST_LR:
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
