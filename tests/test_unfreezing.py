"""The trainable-set change behind ``reconfigure_trainable``, worked out without a Trainer or DeepSpeed."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_frozen.errors import FrozenSetChangedError
from lightning_frozen.unfreezing import check_trainable_set_unchanged, groups_from_checkpoint, plan_change


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    return model


def test_plan_of_an_unfreeze_keeps_the_old_group_and_adds_the_new_one() -> None:
    model = _model()
    model[0].requires_grad_(True)
    groups = [{"params": list(model[1].parameters()), "lr": 0.1}, {"params": list(model[0].parameters()), "lr": 0.01}]
    change = plan_change(model, groups, [0, None], [["1.weight", "1.bias"]])
    assert change.group_names == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    assert change.keep == ["1.weight", "1.bias"] and change.added == ["0.bias", "0.weight"]
    assert change.refrozen == [] and change.continued == [0]
    assert [g["lr"] for g in change.groups] == [0.1, 0.01]
    assert "2 tensors unfrozen, 0 frozen" in change.summary(carried=2)


def test_plan_of_a_refreeze_drops_the_emptied_group() -> None:
    model = _model()
    model[0].requires_grad_(True)
    current = [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    model[1].requires_grad_(False)
    groups = [{"params": list(model[1].parameters())}, {"params": list(model[0].parameters())}]
    change = plan_change(model, groups, [0, 1], current)
    assert change.group_names == [["0.weight", "0.bias"]] and change.continued == [1]
    assert [id(p) for p in change.refrozen] == [id(model[1].weight), id(model[1].bias)] and change.added == []


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
    groups, origins = groups_from_checkpoint(model, saved, num_current_groups=1)
    assert all(p.requires_grad for p in model.parameters()) and origins == [0, None]
    assert [id(p) for p in groups[1]["params"]] == [id(model[0].weight), id(model[0].bias)] and groups[1]["lr"] == 0.01
    assert groups_from_checkpoint(model, saved, num_current_groups=2) is None  # nothing differs now


def test_a_flag_flipped_mid_run_is_refused_with_the_names() -> None:
    model = _model()
    watched = list(model.named_parameters())
    flags = tuple(p.requires_grad for _, p in watched)
    check_trainable_set_unchanged(watched, flags)
    model[0].weight.requires_grad_(True)
    model[1].bias.requires_grad_(False)
    with pytest.raises(FrozenSetChangedError, match=r"unfrozen `0.weight`; frozen `1.bias`;.*BaseFinetuning"):
        check_trainable_set_unchanged(watched, flags)
