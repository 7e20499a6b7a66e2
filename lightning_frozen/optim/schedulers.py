"""LR schedulers and the param groups a finetuning callback adds mid-run: :func:`follow_added_groups` gives an added
group what the scheduler's existing groups share, read from the scheduler itself (torch pairs each group with its
per-group values strictly; docs/internals.md, "Optimizer groups"). :func:`register_per_group_attributes`, which code
written for earlier versions calls, is now a no-op that says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_frozen.zero.optimizers import SUB_SCHEDULER_KEYS, scheduler_chain


def follow_added_groups(scheduler: Any, optimizer: Optimizer, num_groups_before: int) -> None:
    """Extend each scheduler (of ``scheduler``'s chain) that holds one value per group for ``num_groups_before`` groups
    to the groups of ``optimizer`` after them, added mid-run: ``base_lrs`` gets an added group's ``initial_lr``
    (default: its ``lr``), any other list as long as the groups were whose entries are all one value gets that value;
    a list whose entries differ is left as it is."""
    added = optimizer.param_groups[num_groups_before:]
    if not added:
        return
    for group in added:
        group.setdefault("initial_lr", group["lr"])
    for inner in scheduler_chain(scheduler):
        if any(getattr(inner, key, None) for key in SUB_SCHEDULER_KEYS):
            continue
        for key, values in list(vars(inner).items()):
            if not isinstance(values, (list, tuple)) or len(values) != num_groups_before:
                continue
            if key == "base_lrs":
                setattr(inner, key, type(values)([*values, *(group["initial_lr"] for group in added)]))
            elif _one_value(values):
                setattr(inner, key, type(values)([*values, *([values[0]] * len(added))]))


def _one_value(values: Sequence[Any]) -> bool:
    first = values[0]
    try:
        return all(value is first or bool(value == first) for value in values)
    except (RuntimeError, TypeError, ValueError):  # values without a plain equality (tensors of several elements)
        return False


def register_per_group_attributes(scheduler_class: type, *names: str) -> None:
    """Does nothing, and warns: every scheduler now works without declaring its per-group attributes (issue 39)."""
    warnings.warn(
        f"lightning-frozen: `register_per_group_attributes({scheduler_class.__name__}, ...)` is no longer needed and"
        " does nothing: the strategy keeps every param group, so any LR scheduler works as it is. Remove the call.",
        FutureWarning,
        stacklevel=2,
    )
