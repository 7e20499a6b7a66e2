"""Changing what trains in the middle of a ZeRO-3 run: the plan, the state carried over, and the checks.

DeepSpeed cannot add params to or remove them from an initialised ZeRO-3 optimizer, so the strategy destroys the
engine and initialises a new one over the same (already partitioned) module. Around that rebuild, this module works
out the new param groups (:func:`plan_change`), copies out the fp32 master weights and optimizer state of every param
that keeps training (:func:`carry_state`) and writes them into the new optimizer (:func:`restore_state`). On resume,
:func:`groups_from_checkpoint` makes trainable what was trainable when the checkpoint was saved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_frozen import zero
from lightning_frozen.errors import FrozenSetChangedError, format_names

# what a DeepSpeed engine counts, carried from the destroyed engine to the new one
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


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
    """Whole fp32 weights and optimizer states by param name, taken from one ZeRO optimizer for another."""

    weights: dict[str, Any]
    states: dict[str, dict[str, Any]]


def carry_state(deepspeed_optimizer: Any, module: nn.Module, names: Sequence[str]) -> CarriedState:
    """Copy out the named params' fp32 master weights and optimizer state. Collective."""
    params = dict(module.named_parameters())
    return CarriedState(
        weights={n: zero.full_param(params[n], deepspeed_optimizer) for n in names},
        states={n: zero.optimizer_state_of(deepspeed_optimizer, params[n]) for n in names},
    )


def restore_state(deepspeed_optimizer: Any, module: nn.Module, carried: CarriedState) -> int:
    """Write carried weights and optimizer states into a new ZeRO optimizer; returns how many params had state.

    Only the sub-groups of params with carried state get their lazily made state created, so a group of newly
    trainable params starts fresh at its first real step. Collective.
    """
    params = dict(module.named_parameters())
    for name, weight in carried.weights.items():
        zero.set_full_param(params[name], weight, deepspeed_optimizer)
    with_state = [n for n, state in carried.states.items() if state]
    zero.ensure_optimizer_state(deepspeed_optimizer, [params[n] for n in with_state])
    for name in with_state:
        zero.set_optimizer_state(deepspeed_optimizer, params[name], carried.states[name])
    return len(with_state)


def groups_from_checkpoint(
    module: nn.Module, checkpoint: Mapping[str, Any], num_current_groups: int
) -> Optional[tuple[list[dict[str, Any]], list[Optional[int]]]]:
    """The param groups (and their origins) a checkpoint was saved with, when its trainable set differs from the
    module's now; the module's ``requires_grad`` flags are set to the checkpoint's. None when nothing differs."""
    params = dict(module.named_parameters())
    saved_groups = (checkpoint.get("optimizer_states") or [{}])[0].get("param_groups")
    saved = {n for n in checkpoint["state_dict"] if n in params}
    current = {n for n, p in params.items() if p.requires_grad}
    if not saved_groups or saved == current:
        return None
    for name, param in params.items():
        param.requires_grad_(name in saved)
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in group["params"]]}
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
