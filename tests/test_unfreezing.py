"""The trainable-set change behind ``reconfigure_trainable``, the trainable groups a run records and checks, the
stand-in optimizer a finetuning callback changes, and the finetuning callbacks' checks, worked out without fitting or
DeepSpeed."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_frozen.errors import FrozenSetChangedError, UnsupportedConfigurationError
from lightning_frozen.optim.trainable_groups import TrainableGroups, check_trainable_set_unchanged
from lightning_frozen.optim.unfreezing import (
    StagedOptimizer,
    check_finetuning_callbacks,
    groups_from_checkpoint,
    plan_change,
)


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    return model


def test_plan_of_an_unfreeze_keeps_the_old_group_and_adds_the_new_one() -> None:
    model = _model()
    model[0].requires_grad_(True)
    groups = [{"params": list(model[1].parameters()), "lr": 0.1}, {"params": list(model[0].parameters()), "lr": 0.01}]
    change = plan_change(model, groups, [["1.weight", "1.bias"]])
    assert change.group_names == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    assert change.keep == ["1.weight", "1.bias"] and change.added == ["0.bias", "0.weight"]
    assert change.refrozen == []
    assert [g["lr"] for g in change.groups] == [0.1, 0.01]
    assert "2 tensors unfrozen, 0 frozen" in change.summary(carried=2)


def test_plan_of_a_refreeze_keeps_the_group_it_empties_so_that_indices_hold() -> None:
    model = _model()
    model[0].requires_grad_(True)
    current = [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    model[1].requires_grad_(False)
    groups = [{"params": list(model[1].parameters())}, {"params": list(model[0].parameters())}]
    change = plan_change(model, groups, current)
    assert change.group_names == current and change.keep == ["0.weight", "0.bias"]
    assert [id(p) for p in change.refrozen] == [id(model[1].weight), id(model[1].bias)] and change.added == []


def test_plan_of_an_unfreeze_in_the_group_a_frozen_param_was_in() -> None:
    model = _model()
    groups = [{"params": [*model[1].parameters(), *model[0].parameters()], "lr": 0.1}]
    model[0].weight.requires_grad_(True)  # trained until now: `1.weight`, `1.bias`
    change = plan_change(model, groups, [["1.weight", "1.bias"]])
    assert change.group_names == [["1.weight", "1.bias", "0.weight", "0.bias"]] and change.added == ["0.weight"]
    assert change.keep == ["1.weight", "1.bias"] and change.refrozen == []


def test_a_checkpoint_with_another_trainable_set_sets_the_flags_and_gives_its_groups() -> None:
    model = _model()
    saved = {
        "state_dict": {"0.weight": None, "0.bias": None, "1.weight": None, "1.bias": None},
        "optimizer_states": [
            {
                "param_groups": [
                    {"lr": 0.1, "params": ["1.weight", "1.bias"]},
                    {"lr": 0.01, "params": ["0.weight", "0.bias"]},
                ]
            }
        ],
    }
    groups = groups_from_checkpoint(model, saved)
    assert all(p.requires_grad for p in model.parameters())
    assert [id(p) for p in groups[1]["params"]] == [id(model[0].weight), id(model[0].bias)] and groups[1]["lr"] == 0.01
    assert groups_from_checkpoint(model, saved) is None  # nothing differs now


def test_a_flag_flipped_mid_run_is_refused_with_the_names() -> None:
    model = _model()
    watched = list(model.named_parameters())
    flags = tuple(p.requires_grad for _, p in watched)
    check_trainable_set_unchanged(watched, flags)
    model[0].weight.requires_grad_(True)
    model[1].bias.requires_grad_(False)
    with pytest.raises(FrozenSetChangedError, match=r"unfrozen `0.weight`; frozen `1.bias`;.*BaseFinetuning"):
        check_trainable_set_unchanged(watched, flags)


def test_the_trainable_groups_record_flags_and_ungrouped_params_and_forget_groups() -> None:
    model = _model()
    optimizer = torch.optim.SGD([model[1].weight], lr=0.1)  # `1.bias` trains but is in no group
    optimized = TrainableGroups()
    optimized.record_groups(model, optimizer)
    optimized.record_flags(model, optimizer)
    assert optimized.group_names == [["1.weight"]] and optimized.ungrouped_names == ["1.bias"]
    assert optimized.trained_names() == [["1.weight"]]
    model(torch.ones(1, 3)).sum().backward()
    assert model[1].bias.grad is None and model[1].weight.grad is not None  # plain torch would never step it
    optimized.check_unchanged()
    model[0].bias.requires_grad_(True)
    with pytest.raises(FrozenSetChangedError, match="unfrozen `0.bias`"):
        optimized.check_unchanged()
    optimized.forget_groups()
    assert optimized.group_names == [] and optimized.watched == []
    optimized.check_unchanged()  # nothing watched: a new run records again


def test_the_staged_optimizer_applies_hyperparameters_or_reports_a_new_trainable_set() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    staged = StagedOptimizer(model, optimizer, [["1.weight", "1.bias"]])
    assert staged.param_groups[0]["params"][0] is model[1].weight and staged.optimizer_class is torch.optim.SGD
    staged.param_groups[0]["lr"] = 0.05
    assert staged.apply_hyperparameters(model, optimizer) and optimizer.param_groups[0]["lr"] == 0.05
    with pytest.raises(ValueError, match="more than one parameter group"):
        staged.add_param_group({"params": model[1].weight})
    model[0].requires_grad_(True)
    staged.add_param_group({"params": model[0].parameters(), "lr": 0.01})
    staged.param_groups[0]["lr"] = 0.5
    assert not staged.apply_hyperparameters(model, optimizer) and len(staged.param_groups) == 2
    assert optimizer.param_groups[0]["lr"] == 0.05  # left to the rebuild over `staged.param_groups`
    assert staged.param_groups[1]["momentum"] == 0  # the optimizer's defaults fill what the group leaves out


def test_lightning_finetuning_callbacks_are_refused_and_ours_accepted() -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning as LightningBackboneFinetuning

    import lightning_frozen
    from tests.models import AdapterModel

    module = AdapterModel()
    module.trainer = L.Trainer(callbacks=[LightningBackboneFinetuning(unfreeze_backbone_at_epoch=1)], logger=False)
    with pytest.raises(UnsupportedConfigurationError, match="Import `BaseFinetuning`/`BackboneFinetuning` from"):
        check_finetuning_callbacks(module)

    class FreezeLayers(lightning_frozen.BaseFinetuning):
        def freeze_before_training(self, pl_module: nn.Module) -> None:
            self.freeze(pl_module.layers)

        def finetune_function(self, *args: object) -> None: ...

    module.trainer = L.Trainer(callbacks=[FreezeLayers()], logger=False)
    check_finetuning_callbacks(module)  # ours hand their freeze to the strategy in `setup` (test_finetuning.py)
    check_finetuning_callbacks(nn.Linear(2, 2))  # no Trainer attached: nothing to check
