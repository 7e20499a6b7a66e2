"""What ``configure_optimizers`` returns, made ready for ZeRO-3: groups kept as they are, ``lr=0`` groups frozen,
foreign and ungrouped params, CPU Adam: plain torch, no Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_frozen.errors import (
    ForeignParametersError,
    NoTrainableParametersError,
    UnsupportedOffloadOptimizerError,
)
from lightning_frozen.optim.filtering import (
    check_params_belong_to,
    discard_gradients,
    lr_zero_group_indices,
    prepare_for_zero,
    to_cpu_adam,
    ungrouped_trainable_names,
)
from lightning_frozen.optim.schedulers import register_per_group_attributes


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def _prepare(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, convert_lr_zero: bool = True):
    return prepare_for_zero(model, optimizer, scheduler, convert_lr_zero, "FrozenAwareDeepSpeedStrategy")


def test_the_groups_stay_as_built_frozen_params_and_wholly_frozen_groups_included() -> None:
    model = _model()
    groups = [
        {"params": [model[0].weight], "lr": 0.5},  # all frozen: DeepSpeed leaves it out, its index stays
        {"params": [model[1].weight, model[0].bias], "lr": 0.1, "momentum": 0.9},
        {"params": list(model[2].parameters()), "lr": 0.01, "weight_decay": 0.1},
    ]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 10.0, lambda s: 0.5, lambda s: 0.25 * (s + 1)])
    assert _prepare(model, optimizer, scheduler) is optimizer
    assert [g["params"] for g in optimizer.param_groups] == [g["params"] for g in groups]
    assert [g["lr"] for g in optimizer.param_groups] == [0.5 * 10.0, 0.1 * 0.5, 0.01 * 0.25]
    assert scheduler.base_lrs == [0.5, 0.1, 0.01] and len(scheduler.lr_lambdas) == 3


def test_an_optimizer_of_frozen_params_only_is_refused_with_the_fix() -> None:
    model = _model()
    with pytest.raises(NoTrainableParametersError, match=r"holds only frozen parameters.*p.requires_grad"):
        _prepare(model, torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_register_per_group_attributes_is_a_no_op_that_says_so() -> None:
    with pytest.warns(FutureWarning, match=r"`register_per_group_attributes\(StepLR, ...\)` is no longer needed"):
        register_per_group_attributes(torch.optim.lr_scheduler.StepLR, "base_lrs")


def test_lr_zero_for_the_whole_run_is_detected_but_warmup_from_zero_is_not() -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 0.0},
            {"params": model[1].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 1e-3},
        ]
    )
    # warm-up from 0 on every group: groups 1 and 2 start at lr 0 too, but their base LR is not 0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 10)
    assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.0, 0.0]
    assert lr_zero_group_indices(optimizer, scheduler) == [0]


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
        lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.0, max_lr=0.1),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4),
    ],
    ids=["one-cycle", "cyclic", "cosine-eta-min"],
)
def test_schedulers_that_raise_a_zero_lr_never_freeze(make_scheduler) -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    scheduler = make_scheduler(optimizer)
    assert lr_zero_group_indices(optimizer, scheduler) == []


def test_prepare_freezes_lr_zero_params_and_says_so(lightning_log) -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters()}], lr=1)
    _prepare(model, optimizer)
    assert not model[0].weight.requires_grad and not model[0].bias.requires_grad
    assert model[1].weight.requires_grad and model[2].weight.requires_grad
    assert optimizer.param_groups[0]["params"] == list(model[0].parameters())  # DeepSpeed leaves them out
    assert "froze 2 parameter tensors (20 elements) whose learning rate is 0" in lightning_log.text


def test_prepare_can_leave_lr_zero_groups_alone() -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters()}], lr=1)
    with pytest.warns(UserWarning, match="every parameter .* is trainable"):
        _prepare(model, optimizer, convert_lr_zero=False)
    assert model[0].weight.requires_grad and len(optimizer.param_groups) == 2


def test_foreign_params_are_named_by_shape() -> None:
    model = _model()
    stray = nn.Parameter(torch.zeros(7, 3))
    optimizer = torch.optim.SGD([*model[1].parameters(), stray], lr=0.1)
    with pytest.raises(ForeignParametersError, match=r"1 tensor\(s\).*\(7, 3\)"):
        check_params_belong_to(model, optimizer)


@pytest.mark.slow
def test_adam_becomes_cpu_adam_with_the_same_hyper_parameters() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = _model()
    optimizer = torch.optim.AdamW(
        [{"params": model[1].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "weight_decay": 0.5}],
        lr=0.01,
        betas=(0.8, 0.9),
        eps=1e-6,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    converted = to_cpu_adam(optimizer, scheduler)
    assert isinstance(converted, DeepSpeedCPUAdam) and converted.adam_w_mode
    assert [g["lr"] for g in converted.param_groups] == [0.1, 0.01]
    assert [g["weight_decay"] for g in converted.param_groups] == [0.01, 0.5]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in converted.param_groups)
    assert scheduler.optimizer is converted


def test_other_optimizers_are_refused_for_offload_with_the_fix() -> None:
    model = _model()
    with pytest.raises(UnsupportedOffloadOptimizerError, match="SGD.*offload_optimizer=False"):
        to_cpu_adam(torch.optim.SGD(model[1].parameters(), lr=0.1))


def test_trainable_params_in_no_group_are_named_and_their_gradients_dropped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    assert ungrouped_trainable_names(model, optimizer) == ["1.weight", "1.bias"]
    handles = discard_gradients([model[1].weight, model[1].bias])
    before = model[1].weight.detach().clone()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    assert model[1].weight.grad is None and model[1].bias.grad is None
    assert model[2].weight.grad is not None and torch.equal(model[1].weight, before)
    for handle in handles:
        handle.remove()
    model(torch.randn(8, 4)).sum().backward()
    assert model[1].weight.grad is not None
