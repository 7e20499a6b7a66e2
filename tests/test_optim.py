"""Stripping frozen params from optimizers and keeping LR schedulers consistent: plain torch, no Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_frozen.errors import ForeignParametersError, UnsupportedOffloadOptimizerError
from lightning_frozen.optim.filtering import (
    check_params_belong_to,
    discard_gradients,
    lr_zero_group_indices,
    prepare_optimizer,
    strip_frozen_params,
    to_cpu_adam,
    ungrouped_trainable_names,
)


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def test_strip_keeps_per_group_hyper_parameters_and_drops_emptied_groups() -> None:
    model = _model()
    optimizer = torch.optim.SGD(
        [
            {"params": [model[0].weight], "lr": 0.5},  # all frozen: dropped
            {"params": [model[1].weight, model[0].bias], "lr": 0.1, "momentum": 0.9},
            {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0.1},
        ],
        lr=1.0,
    )
    report = strip_frozen_params(optimizer)
    assert report.dropped_groups == [0]
    assert report.stripped_params == 2 and report.stripped_numel == 16 + 4
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.01]
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[1]["weight_decay"] == 0.1
    assert [p for group in optimizer.param_groups for p in group["params"]] == [
        model[1].weight,
        model[2].weight,
        model[2].bias,
    ]


def test_per_group_lambdas_follow_their_groups_after_a_group_is_dropped() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1.0},
            {"params": model[1].parameters(), "lr": 2.0},
            {"params": model[2].parameters(), "lr": 3.0},
        ]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 10.0, lambda s: 0.5, lambda s: 0.25 * (s + 1)])
    strip_frozen_params(optimizer, scheduler)
    assert scheduler.base_lrs == [2.0, 3.0]
    assert len(scheduler.lr_lambdas) == 2
    optimizer.step()
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == [1.0, 3.0 * 0.25 * 2]


def test_sequential_scheduler_inner_schedulers_are_filtered_too() -> None:
    model = _model()
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=1.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[2])
    strip_frozen_params(optimizer, scheduler)
    assert len(optimizer.param_groups) == 1
    for inner in (warmup, cosine):
        assert inner.base_lrs == [1.0]
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert 0 < optimizer.param_groups[0]["lr"] < 1.0


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


def test_prepare_freezes_lr_zero_params_and_strips_them() -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters()}], lr=1)
    report = prepare_optimizer(model, optimizer)
    assert report.lr_zero_params == 2 and report.lr_zero_numel == 20
    assert not model[0].weight.requires_grad and not model[0].bias.requires_grad
    assert model[1].weight.requires_grad and model[2].weight.requires_grad
    assert report.dropped_groups == [0] and optimizer.param_groups[0]["params"] == list(model[1].parameters())


def test_prepare_can_leave_lr_zero_groups_alone() -> None:
    model = _model()
    model.requires_grad_(True)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters()}], lr=1)
    report = prepare_optimizer(model, optimizer, convert_lr_zero=False)
    assert report.lr_zero_params == 0
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
