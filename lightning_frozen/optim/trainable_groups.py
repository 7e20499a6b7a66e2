"""Every run's record of what its ZeRO optimizer was built over: the param groups by name, the trainable flags, and
the trainable params in no group.

Checkpoints key the optimizer state by these names (``checkpoint/trainable_state.py``), a rebuild after unfreezing
replaces them (``unfreezing.py``), and each training step checks that no ``requires_grad`` flipped behind the
strategy's back (:func:`check_trainable_set_unchanged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_frozen.errors import FrozenSetChangedError, format_names
from lightning_frozen.optim.filtering import leave_ungrouped_unstepped


@dataclass
class TrainableGroups:
    """What the ZeRO optimizer of a run was built over: its groups' param names (frozen ones included), and every
    param's ``requires_grad`` then (checked each training step); and the trainable params in no group, with the hooks
    that drop their gradients."""

    group_names: list[list[str]] = field(default_factory=list)
    watched: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    flags: tuple[bool, ...] = ()
    ungrouped_names: list[str] = field(default_factory=list)
    ungrouped_hooks: list[Any] = field(default_factory=list)

    def record_groups(self, module: nn.Module, optimizer: Optimizer) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        self.group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def trained_names(self) -> list[list[str]]:
        """Each group's params that train (``requires_grad`` as the engine was built): those with an fp32 master copy
        and optimizer state. The groups themselves hold frozen params too, as the user's optimizer does."""
        trained = {name for (name, _), flag in zip(self.watched, self.flags) if flag}
        return [[name for name in names if name in trained] for names in self.group_names]

    def record_flags(self, module: nn.Module, optimizer: Optional[Optimizer]) -> None:
        """As an engine is built over ``module`` and ``optimizer``: the flags to hold, and the ungrouped params."""
        if optimizer is not None:
            self.ungrouped_names, self.ungrouped_hooks = leave_ungrouped_unstepped(
                module, optimizer, self.ungrouped_names, self.ungrouped_hooks
            )
        self.watched = list(module.named_parameters())
        self.flags = tuple(p.requires_grad for _, p in self.watched)

    def forget_groups(self) -> None:
        """For a run on another module (the ungrouped params' hooks go when the next engine is built)."""
        self.group_names, self.watched, self.flags = [], [], ()

    def check_unchanged(self) -> None:
        """See :func:`check_trainable_set_unchanged`."""
        check_trainable_set_unchanged(self.watched, self.flags)


def check_trainable_set_unchanged(watched: Sequence[tuple[str, nn.Parameter]], flags: Sequence[bool]) -> None:
    """Refuse a ``requires_grad`` flipped since the optimizer was built (``flags``, one per watched param).

    Raises:
        FrozenSetChangedError: naming the params unfrozen and frozen, and the fix.
    """
    if tuple(p.requires_grad for _, p in watched) == tuple(flags):
        return
    changed = [(name, param.requires_grad) for (name, param), was in zip(watched, flags) if param.requires_grad != was]
    unfrozen = [name for name, now in changed if now]
    frozen = [name for name, now in changed if not now]
    raise FrozenSetChangedError(
        "The set of trainable parameters changed during training:"
        + (f" unfrozen {format_names(unfrozen)};" if unfrozen else "")
        + (f" frozen {format_names(frozen)};" if frozen else "")
        + " the ZeRO optimizer was built for the set at the start of `fit`, so these would be silently"
        " ignored or trained without state. Set `requires_grad` before `fit`, or change it mid-run through"
        " `lightning_frozen.BaseFinetuning` / `BackboneFinetuning`, which rebuild the optimizer."
    )
