"""Changing what trains in the middle of a ZeRO-3 run: the plan, the state carried over, and the checks.

DeepSpeed cannot add params to or remove them from an initialised ZeRO-3 optimizer, so the strategy destroys the
engine and initialises a new one over the same (already partitioned) module. Around that rebuild, this module works
out the new param groups (:func:`plan_change`), copies out the fp32 master weights and optimizer state of every param
that keeps training (:func:`carry_state`) and writes them into the new optimizer (:func:`restore_state`). On resume,
:func:`groups_from_checkpoint` makes trainable what was trainable when the checkpoint was saved.

Between changes, :class:`OptimizedSet` holds what the optimizer was built for, and each training step checks that
no ``requires_grad`` flipped behind the strategy's back. Our finetuning callbacks declare ``ZERO3_FINETUNING``; the
strategy refuses Lightning's own (:func:`check_finetuning_callbacks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning
from torch import nn
from torch.optim import Optimizer

from lightning_frozen.checkpoint import layout
from lightning_frozen.errors import FrozenSetChangedError, UnsupportedConfigurationError, format_names
from lightning_frozen.optim.filtering import leave_ungrouped_unstepped
from lightning_frozen.zero import params as zero
from lightning_frozen.zero.optimizers import engine_counters, set_engine_counters

# A finetuning callback with this class attribute set to True unfreezes through the strategy's
# `reconfigure_trainable`, and its `freeze_before_training(module)` runs once `configure_model` has built the model.
ZERO3_FINETUNING = "unfreezes_under_zero3"


def _callbacks(module: nn.Module) -> list[Any]:
    trainer = getattr(module, "_trainer", None)  # `LightningModule.trainer` raises when none is attached
    return list(trainer.callbacks) if trainer is not None else []


def check_finetuning_callbacks(module: nn.Module) -> None:
    """Refuse Lightning's own finetuning callbacks on ``module``'s Trainer: they raise for every DeepSpeed strategy.

    Raises:
        UnsupportedConfigurationError: naming the callback and ours to use instead.
    """
    for callback in _callbacks(module):
        if isinstance(callback, LightningBaseFinetuning) and not getattr(callback, ZERO3_FINETUNING, False):
            raise UnsupportedConfigurationError(
                f"Lightning's `{type(callback).__name__}` refuses every DeepSpeed strategy. Import"
                " `BaseFinetuning`/`BackboneFinetuning` from `lightning_frozen` instead (same names and"
                " arguments): they unfreeze and freeze params under ZeRO-3 by rebuilding the optimizer."
            )


def freeze_for_finetuning_callbacks(module: nn.Module) -> None:
    """Run our finetuning callbacks' freeze after ``configure_model`` built the (sharded) ``module``; Lightning's
    freeze in their ``setup``, before it."""
    for callback in _callbacks(module):
        if getattr(callback, ZERO3_FINETUNING, False):
            callback.freeze_before_training(module)


@dataclass
class OptimizedSet:
    """What the ZeRO optimizer of a run was built over: its groups' param names, and every param's
    ``requires_grad`` then (checked each training step); and the trainable params in no group, with the hooks that
    drop their gradients."""

    group_names: list[list[str]] = field(default_factory=list)
    watched: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    flags: tuple[bool, ...] = ()
    ungrouped_names: list[str] = field(default_factory=list)
    ungrouped_hooks: list[Any] = field(default_factory=list)

    def record_groups(self, module: nn.Module, optimizer: Optimizer) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        self.group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

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


@dataclass
class TrainableChange:
    """A new trainable set, by param group, against the groups the ZeRO optimizer holds now."""

    groups: list[dict[str, Any]]  # the new groups, trainable params only; groups left empty are dropped
    group_names: list[list[str]]  # their params' names
    continued: list[int]  # for each new group that continues a current one, the current group's index
    keep: list[str]  # params trainable before and after: their weights and state are carried over
    refrozen: list[nn.Parameter]  # params that stop training
    added: list[str]  # params that start training

    def summary(self, carried: int) -> str:
        return (
            f"lightning-frozen: trainable set changed: {len(self.added)} tensors unfrozen, {len(self.refrozen)}"
            f" frozen; optimizer rebuilt with {len(self.groups)} param groups, state of {carried} tensors carried over."
        )


def plan_change(
    module: nn.Module,
    param_groups: Sequence[dict[str, Any]],
    origins: Sequence[Optional[int]],
    current_group_names: Sequence[Sequence[str]],
) -> TrainableChange:
    """The change from the current groups (by name) to ``param_groups``; ``origins[i]`` is the current group that
    group ``i`` continues, or None for a new group. Params made trainable but put in no group are left out."""
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    kept_groups = [(g, o) for g, o in zip(param_groups, origins) if any(p.requires_grad for p in g["params"])]
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g, _ in kept_groups]
    group_names = [[names[id(p)] for p in g["params"]] for g in groups]
    new_set = {n for group in group_names for n in group}
    old_names = [n for group in current_group_names for n in group]
    return TrainableChange(
        groups=groups,
        group_names=group_names,
        continued=[o for _, o in kept_groups if o is not None],
        keep=[n for n in old_names if n in new_set],
        refrozen=[params[n] for n in old_names if n not in new_set],
        added=sorted(new_set - set(old_names)),
    )


@dataclass
class CarriedState:
    """Whole fp32 weights and optimizer states by param name, and the engine's step counters, taken from one
    DeepSpeed engine for another."""

    weights: dict[str, Any]
    states: dict[str, dict[str, Any]]
    counters: dict[str, Any]


def carry_state(engine: Any, module: nn.Module, names: Sequence[str]) -> CarriedState:
    """Copy out the named params' fp32 master weights and optimizer state, and ``engine``'s counters. Collective."""
    params = dict(module.named_parameters())
    return CarriedState(
        weights={n: zero.full_param(params[n], engine.optimizer) for n in names},
        states={n: zero.optimizer_state_of(engine.optimizer, params[n]) for n in names},
        counters=engine_counters(engine),
    )


def restore_state(engine: Any, module: nn.Module, carried: CarriedState) -> int:
    """Write carried state into a new engine and its ZeRO optimizer; returns how many params had optimizer state.

    Only the sub-groups of params with carried state get their lazily made state created, so a group of newly
    trainable params starts fresh at its first real step. Collective.
    """
    set_engine_counters(engine, carried.counters)
    params = dict(module.named_parameters())
    for name, weight in carried.weights.items():
        zero.set_full_param(params[name], weight, engine.optimizer)
    with_state = [n for n, state in carried.states.items() if state]
    zero.ensure_optimizer_state(engine.optimizer, [params[n] for n in with_state])
    for name in with_state:
        zero.set_optimizer_state(engine.optimizer, params[name], carried.states[name])
    return len(with_state)


def groups_from_checkpoint(
    module: nn.Module, checkpoint: Mapping[str, Any], num_current_groups: int
) -> Optional[tuple[list[dict[str, Any]], list[Optional[int]]]]:
    """The param groups (and their origins) a checkpoint was saved with, when its trainable set differs from the
    module's now; the module's ``requires_grad`` flags are set to the checkpoint's. None when nothing differs."""
    params = dict(module.named_parameters())
    saved_groups = layout.saved_param_groups(checkpoint)
    saved = {n for n in layout.state_dict_of(checkpoint) if n in params}
    current = {n for n, p in params.items() if p.requires_grad}
    if not saved_groups or saved == current:
        return None
    for name, param in params.items():
        param.requires_grad_(name in saved)
    groups = [
        {**layout.group_hyper_parameters(group), "params": [params[n] for n in group[layout.GROUP_PARAMS]]}
        for group in saved_groups
    ]
    return groups, [i if i < num_current_groups else None for i in range(len(groups))]


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
