"""Changing what trains in the middle of a ZeRO-3 run: the stand-in optimizer a finetuning callback changes
(:class:`StagedOptimizer`, applied by :func:`stage`), the plan (:func:`plan_change`), the state carried over the
rebuild of the engine (:func:`carry_state`, :func:`restore_state`), what a resumed run makes trainable
(:func:`groups_from_checkpoint`), and the refusal of Lightning's own callbacks (:func:`check_finetuning_callbacks`).
DeepSpeed cannot add params to an initialised ZeRO-3 optimizer, so a new trainable set rebuilds the engine over the
same module; groups keep their frozen params, so the scheduler's groups keep their indices (docs/unfreezing.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning
from torch import nn

from lightning_frozen.errors import UnsupportedConfigurationError
from lightning_frozen.format import layout
from lightning_frozen.zero.optimizers import engine_counters, inner_optimizer, set_engine_counters
from lightning_frozen.zero.params import (
    ensure_optimizer_state,
    full_param,
    optimizer_state_of,
    set_full_param,
    set_optimizer_state,
)


def _callbacks(module: nn.Module) -> list[Any]:
    try:
        return list(module.trainer.callbacks)
    except (AttributeError, RuntimeError):  # no Trainer attached (Lightning's `trainer` raises RuntimeError)
        return []


def check_finetuning_callbacks(module: nn.Module) -> None:
    """Refuse finetuning callbacks whose ``setup`` is Lightning's on ``module``'s Trainer: it raises for every
    DeepSpeed strategy. Ours (``lightning_frozen.BaseFinetuning``) hand their freeze to the strategy there instead.

    Raises:
        UnsupportedConfigurationError: naming the callback and ours to use instead.
    """
    for callback in _callbacks(module):
        if isinstance(callback, LightningBaseFinetuning) and type(callback).setup is LightningBaseFinetuning.setup:
            raise UnsupportedConfigurationError(
                f"Lightning's `{type(callback).__name__}` refuses every DeepSpeed strategy. Import"
                " `BaseFinetuning`/`BackboneFinetuning` from `lightning_frozen` instead (same names and"
                " arguments): they unfreeze and freeze params under ZeRO-3 by rebuilding the optimizer."
            )


class StagedOptimizer:
    """What a finetuning callback's ``finetune_function`` sees instead of the ZeRO optimizer: copies of its groups with
    their real params, and ``add_param_group``; :func:`stage` applies them afterwards."""

    def __init__(self, module: nn.Module, optimizer: Any, group_names: Sequence[Sequence[str]]) -> None:
        params = dict(module.named_parameters())
        inner = inner_optimizer(optimizer)
        self.optimizer_class = type(inner)
        self.defaults = dict(getattr(optimizer, "defaults", None) or inner.defaults)
        self.param_groups: list[dict[str, Any]] = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in names]}
            for group, names in zip(optimizer.param_groups, group_names)
        ]
        self._flags = {id(p): p.requires_grad for p in module.parameters()}
        self._num_groups = len(self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, nn.Parameter) else list(params)
        present = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in present for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append({**self.defaults, **param_group, "params": params})

    def apply_hyperparameters(self, module: nn.Module, optimizer: Any) -> bool:
        """Give the real ``optimizer``'s groups (the same, in the same order) the stand-in's hyper-parameters, unless a
        group was added or a ``requires_grad`` of ``module`` flipped: then return False (the optimizer is rebuilt)."""
        flipped = any(p.requires_grad != self._flags.get(id(p), p.requires_grad) for p in module.parameters())
        if flipped or len(self.param_groups) != self._num_groups:
            return False
        for real, group in zip(optimizer.param_groups, self.param_groups):
            real.update({k: v for k, v in group.items() if k != "params"})
        return True


def stage(
    module: nn.Module, optimizer: Any, group_names: Sequence[Sequence[str]], finetune: Callable[[StagedOptimizer], None]
) -> Optional[list[dict[str, Any]]]:
    """Run ``finetune`` (a finetuning callback's change) on a :class:`StagedOptimizer` of ``optimizer``, whose groups
    hold the params named in ``group_names``. New hyper-parameters alone go to ``optimizer`` (None is returned); a new
    trainable set returns the new groups, for the strategy to rebuild the optimizer over."""
    staged = StagedOptimizer(module, optimizer, group_names)
    finetune(staged)
    if staged.apply_hyperparameters(module, optimizer):
        return None
    return staged.param_groups


@dataclass
class TrainableChange:
    """A new trainable set, by param group, against the groups the ZeRO optimizer holds now."""

    groups: list[dict[str, Any]]  # the new groups, frozen params included: the current ones in order, then new ones
    group_names: list[list[str]]  # their params' names
    keep: list[str]  # params trainable before and after: their weights and state are carried over
    refrozen: list[nn.Parameter]  # params that stop training
    added: list[str]  # params that start training

    def summary(self, carried: int) -> str:
        return (
            f"lightning-frozen: trainable set changed: {len(self.added)} tensors unfrozen, {len(self.refrozen)}"
            f" frozen; optimizer rebuilt with {len(self.groups)} param groups, state of {carried} tensors carried over."
        )


def plan_change(
    module: nn.Module, param_groups: Sequence[dict[str, Any]], trained_groups: Sequence[Sequence[str]]
) -> TrainableChange:
    """The change from the params that trained until now (``trained_groups``, by name, group by group) to
    ``param_groups``, whose params' ``requires_grad`` say what trains from now on. Params made trainable but put in no
    group are left out."""
    trained = [name for names in trained_groups for name in names]
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    groups = [{**g, "params": list(g["params"])} for g in param_groups]
    group_names = [[names[id(p)] for p in g["params"]] for g in groups]
    new_set = {n for group in group_names for n in group if params[n].requires_grad}
    return TrainableChange(
        groups=groups,
        group_names=group_names,
        keep=[n for n in trained if n in new_set],
        refrozen=[params[n] for n in trained if n not in new_set],
        added=sorted(new_set - set(trained)),
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
        weights={n: full_param(params[n], engine.optimizer) for n in names},
        states={n: optimizer_state_of(engine.optimizer, params[n]) for n in names},
        counters=engine_counters(engine),
    )


def restore_state(engine: Any, module: nn.Module, carried: CarriedState) -> int:
    """Write carried state into a new engine and its ZeRO optimizer; returns how many params had optimizer state
    (newly trainable params start theirs at their first step). Collective."""
    set_engine_counters(engine, carried.counters)
    params = dict(module.named_parameters())
    for name, weight in carried.weights.items():
        set_full_param(params[name], weight, engine.optimizer)
    with_state = [n for n, state in carried.states.items() if state]
    ensure_optimizer_state(engine.optimizer, [params[n] for n in with_state])
    for name in with_state:
        set_optimizer_state(engine.optimizer, params[name], carried.states[name])
    return len(with_state)


def groups_from_checkpoint(module: nn.Module, checkpoint: Mapping[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The param groups a checkpoint was saved with, when its trainable set differs from the module's now; the
    module's ``requires_grad`` flags are set to the checkpoint's. None when nothing differs."""
    params = dict(module.named_parameters())
    saved_groups = layout.saved_param_groups(checkpoint)
    saved = {n for n in layout.state_dict_of(checkpoint) if n in params}
    current = {n for n, p in params.items() if p.requires_grad}
    if not saved_groups or saved == current:
        return None
    for name, param in params.items():
        param.requires_grad_(name in saved)
    return [
        {**layout.group_hyper_parameters(group), "params": [params[n] for n in group[layout.GROUP_PARAMS]]}
        for group in saved_groups
    ]
