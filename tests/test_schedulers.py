"""LR schedulers over the user's param groups, kept as ``configure_optimizers`` built them (frozen params and wholly
frozen groups included, DeepSpeed leaving them out): every group gets exactly the learning rates torch gives it,
whatever the scheduler (torch's, DeepSpeed's, transformers', a user's own class), with no table of per-group
attributes; in plain torch and through a real Trainer fit with ``frozen_deepspeed`` and its DeepSpeed engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from deepspeed.runtime import lr_schedules
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim import lr_scheduler

from lightning_frozen.optim.filtering import prepare_for_zero, same_kind_of_optimizer
from lightning_frozen.optim.schedulers import follow_added_groups
from lightning_frozen.zero.optimizers import keep_empty_groups, point_schedulers_at
from tests.models import AdapterModel, cpu_trainer, regression_data

STEPS = 15
# ReduceLROnPlateau's metric: improves, stalls (lr drops after patience), improves once, stalls again
METRICS = [1.0, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]


def _per_group(n: int, first: float, step: float) -> list[float]:
    return [first + step * k for k in range(n)]


# name -> (optimizer, number of groups) -> scheduler; per-group values differ wherever the API takes a list
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer, int], Any]] = {
    "LambdaLR": lambda o, n: lr_scheduler.LambdaLR(o, [lambda s, k=k: (k + 1) * 0.9**s for k in range(n)]),
    "MultiplicativeLR": lambda o, n: lr_scheduler.MultiplicativeLR(
        o, [lambda s, k=k: 0.95 - 0.1 * k for k in range(n)]
    ),
    "StepLR": lambda o, n: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o, n: lr_scheduler.MultiStepLR(o, milestones=[2, 5, 5, 9], gamma=0.5),
    "ExponentialLR": lambda o, n: lr_scheduler.ExponentialLR(o, gamma=0.8),
    "CosineAnnealingLR": lambda o, n: lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.001),
    "LinearLR": lambda o, n: lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4),
    "ConstantLR": lambda o, n: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
    "PolynomialLR": lambda o, n: lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "OneCycleLR": lambda o, n: lr_scheduler.OneCycleLR(o, max_lr=_per_group(n, 0.5, 0.25), total_steps=STEPS + 1),
    "OneCycleLR-three-phase": lambda o, n: lr_scheduler.OneCycleLR(
        o, max_lr=_per_group(n, 0.5, 0.25), total_steps=STEPS + 1, three_phase=True, anneal_strategy="linear"
    ),
    "CyclicLR": lambda o, n: lr_scheduler.CyclicLR(
        o,
        base_lr=_per_group(n, 0.01, 0.01),
        max_lr=_per_group(n, 0.5, 0.25),
        step_size_up=3,
        mode="triangular2",
        base_momentum=_per_group(n, 0.8, -0.1),
        max_momentum=_per_group(n, 0.9, -0.05),
    ),
    "SequentialLR": lambda o, n: lr_scheduler.SequentialLR(
        o,
        [
            lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            lr_scheduler.ExponentialLR(o, gamma=0.7),
            lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.01),
        ],
        milestones=[3, 7],
    ),
    "ChainedScheduler": lambda o, n: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4), lr_scheduler.ExponentialLR(o, gamma=0.9)]
    ),
    "CosineAnnealingWarmRestarts": lambda o, n: lr_scheduler.CosineAnnealingWarmRestarts(
        o, T_0=3, T_mult=2, eta_min=0.001
    ),
    "ReduceLROnPlateau": lambda o, n: lr_scheduler.ReduceLROnPlateau(
        o, factor=0.5, patience=1, min_lr=_per_group(n, 0.02, 0.03)
    ),
    "deepspeed-WarmupLR": lambda o, n: lr_schedules.WarmupLR(
        o, warmup_min_lr=_per_group(n, 0.0, 0.01), warmup_max_lr=_per_group(n, 0.3, 0.2), warmup_num_steps=5
    ),
    "deepspeed-WarmupDecayLR": lambda o, n: lr_schedules.WarmupDecayLR(
        o,
        total_num_steps=STEPS,
        warmup_min_lr=_per_group(n, 0.0, 0.01),
        warmup_max_lr=_per_group(n, 0.3, 0.2),
        warmup_num_steps=5,
    ),
    "deepspeed-WarmupCosineLR": lambda o, n: lr_schedules.WarmupCosineLR(o, total_num_steps=STEPS, warmup_num_steps=4),
    "deepspeed-OneCycle": lambda o, n: lr_schedules.OneCycle(
        o, cycle_min_lr=_per_group(n, 0.01, 0.01), cycle_max_lr=_per_group(n, 0.4, 0.2), cycle_first_step_size=4
    ),
}


class PeakScheduler(lr_scheduler.LRScheduler):
    """A user's own scheduler: one peak per group in a list of its own, and a list of phases that is not per group."""

    def __init__(self, optimizer: torch.optim.Optimizer, peaks: list[float]) -> None:
        self.peaks = list(peaks)
        self.phases = [3, 100]
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        ramp = min(1.0, self.last_epoch / self.phases[0])
        return [base + (peak - base) * ramp for base, peak in zip(self.base_lrs, self.peaks)]


def _transformers_cosine(optimizer: torch.optim.Optimizer, n: int) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=STEPS)


SCHEDULERS["transformers-cosine-with-warmup"] = _transformers_cosine
SCHEDULERS["users-own-LRScheduler"] = lambda o, n: PeakScheduler(o, _per_group(n, 0.5, 0.25))

# group layouts: T a group with trainable params, F a wholly frozen one (DeepSpeed leaves it out), E an empty one
LAYOUTS = {"frozen-first": "FTT", "frozen-in-the-middle": "TFT", "frozen-last": "TF", "empty-group": "TEFT"}


def _optimizer(layout: str) -> torch.optim.Optimizer:
    groups = []
    for k, kind in enumerate(layout):
        params = [] if kind == "E" else [nn.Parameter(torch.ones(2), requires_grad=kind == "T")]
        groups.append({"params": params, "lr": 0.1 * (k + 1), "weight_decay": 0.01 if k == 0 else 0.0})
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _step(scheduler: Any, step: int) -> None:
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(METRICS[step])
    else:
        scheduler.step()


def _hyper(optimizer: torch.optim.Optimizer) -> list[tuple[float, float]]:
    return [(group["lr"], group["momentum"]) for group in optimizer.param_groups]


def _trajectory(optimizer: torch.optim.Optimizer, scheduler: Any) -> list[Any]:
    seen = [_hyper(optimizer)]
    for step in range(STEPS):
        optimizer.step()
        _step(scheduler, step)
        seen.append(_hyper(optimizer))
    return seen


def _module_of(optimizer: torch.optim.Optimizer) -> nn.Module:
    module = nn.Module()
    module.params = nn.ParameterList([p for group in optimizer.param_groups for p in group["params"]])
    return module


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_group_follows_torchs_own_trajectory_with_frozen_groups_kept(name: str, layout: str) -> None:
    make = SCHEDULERS[name]
    reference_optimizer = _optimizer(layout)
    expected = _trajectory(reference_optimizer, make(reference_optimizer, len(layout)))

    optimizer = _optimizer(layout)
    scheduler = make(optimizer, len(layout))
    prepare_for_zero(_module_of(optimizer), optimizer, scheduler, True, "FrozenAwareDeepSpeedStrategy")
    keep_empty_groups(optimizer, torch.float32)  # what the strategy hands DeepSpeed: no group dropped
    assert len(optimizer.param_groups) == len(layout)
    assert _trajectory(optimizer, scheduler) == expected
    # the lr moved at all, so the comparison compared something (ReduceLROnPlateau and OneCycle included)
    assert len({lrs[0][0] for lrs in expected}) > 1


# schedulers with one value for every group, so that a group added mid-run can take it
SHARED: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.001),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o,
        [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3), lr_scheduler.ExponentialLR(o, gamma=0.7)],
        milestones=[3],
    ),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=0.01),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=STEPS + 1),
    "deepspeed-WarmupLR": lambda o: lr_schedules.WarmupLR(o, warmup_max_lr=0.3, warmup_num_steps=5),
}
# the keys OneCycleLR reads from every group, which a group added mid-run must bring, as in plain torch
ONE_CYCLE_KEYS = {"initial_lr": 0.02, "max_lr": 0.5, "min_lr": 0.02 / 1e4, "max_momentum": 0.95, "base_momentum": 0.85}


def _run_adding_a_group(name: str, extra: dict[str, Any], rebuild: bool, add: bool = True) -> list[Any]:
    """Step a scheduler of ``SHARED`` over the TFT groups, a group added at step 4 (unless not ``add``): to the
    optimizer itself (plain torch, where a finetuning callback calls ``add_param_group``) or, with ``rebuild``, as the
    strategy's rebuild does (a new optimizer over the same groups and the added one, the scheduler pointed at it and
    extended to it). Returns each step's groups' hyper-parameters, or what was raised."""
    optimizer = _optimizer("TFT")
    scheduler = SHARED[name](optimizer)
    seen: list[Any] = []
    try:
        for step in range(STEPS):
            if step == 4 and add:
                added = {"params": [nn.Parameter(torch.ones(3))], "lr": 0.05, **extra}
                if rebuild:
                    groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
                    optimizer = same_kind_of_optimizer(optimizer, groups)
                    point_schedulers_at(scheduler, optimizer)
                optimizer.add_param_group(added)
                if rebuild:
                    follow_added_groups(scheduler, optimizer, 3)
            optimizer.step()
            _step(scheduler, step)
            seen.append(_hyper(optimizer))
    except (KeyError, ValueError) as error:
        seen.append(f"{type(error).__name__}: {error}")
    return seen


@pytest.mark.parametrize("name", list(SHARED))
def test_a_group_added_mid_run_leaves_the_other_groups_on_torchs_trajectory(name: str) -> None:
    extra = ONE_CYCLE_KEYS if name == "OneCycleLR" else {}
    seen = _run_adding_a_group(name, extra, rebuild=True)
    assert len(seen) == STEPS and all(len(step) == 4 for step in seen[4:]), seen[-1]
    assert [step[:3] for step in seen] == _run_adding_a_group(name, extra, rebuild=False, add=False)
    assert all(step[3][0] >= 0 for step in seen[4:])
    plain = _run_adding_a_group(name, extra, rebuild=False)
    if name.startswith("deepspeed-"):  # it zips loosely: plain, the new group stays at its lr; here it warms up too
        assert [step[3] for step in seen[4:]] == [step[0] for step in seen[4:]]
    elif not isinstance(plain[-1], str):  # where plain torch 2.13 copes with the new group, it is the same
        assert seen == plain


def test_a_group_added_under_a_shared_lambda_follows_it_from_its_own_lr() -> None:
    seen = _run_adding_a_group("LambdaLR", {}, rebuild=True)
    assert [step[3][0] for step in seen[4:]] == [0.05 * 0.9 ** (step + 1) for step in range(4, STEPS)]
    # plain torch 2.13 zips the lambdas with the groups strictly: the added group ends the run there
    assert _run_adding_a_group("LambdaLR", {}, rebuild=False)[-1].startswith("ValueError: zip()")


def test_a_group_added_under_a_chainable_scheduler_follows_it_from_its_own_lr() -> None:
    seen = _run_adding_a_group("StepLR", {}, rebuild=True)
    assert [step[3][0] for step in seen[4:7]] == [0.05, 0.05 * 0.5, 0.05 * 0.5]  # StepLR halves every group's lr


def test_a_group_added_where_each_group_has_its_own_value_meets_the_scheduler_as_in_plain_torch() -> None:
    optimizer = _optimizer("TT")
    scheduler = lr_scheduler.LambdaLR(optimizer, [lambda s: 0.9**s, lambda s: 0.8**s])
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": 0.05})
    follow_added_groups(scheduler, optimizer, 2)
    assert len(scheduler.lr_lambdas) == 2  # no lambda can be told for the new group
    with pytest.raises(ValueError, match="zip"):
        scheduler.step()


def test_a_group_added_under_one_cycle_without_its_keys_fails_as_in_plain_torch() -> None:
    seen = _run_adding_a_group("OneCycleLR", {}, rebuild=True)
    assert seen[-1].startswith("KeyError")
    assert _run_adding_a_group("OneCycleLR", {}, rebuild=False)[-1].startswith("KeyError")


# a Trainer fit: the AdapterModel's frozen bases, adapters and an empty group, each a group of its own
TRAINER_SCHEDULERS = [
    "LambdaLR",
    "OneCycleLR",
    "CosineAnnealingWarmRestarts",
    "SequentialLR",
    "ChainedScheduler",
    "ReduceLROnPlateau",
    "transformers-cosine-with-warmup",
    "users-own-LRScheduler",
]
TRAINER_STEPS = 16


def _adapter_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Layer 0's frozen base, an empty group, layer 0's adapter, layer 1's frozen base, layer 1's adapter and the
    head: F E T F T, each with its own lr."""
    named = dict(module.named_parameters())
    names = [
        ["layers.0.base.weight", "layers.0.base.bias"],
        [],
        ["layers.0.lora_a", "layers.0.lora_b"],
        ["layers.1.base.weight", "layers.1.base.bias"],
        ["layers.1.lora_a", "layers.1.lora_b", "head.weight", "head.bias"],
    ]
    return [{"params": [named[n] for n in group], "lr": 0.1 * (k + 1)} for k, group in enumerate(names)]


class PlateauMetric(AdapterModel):
    """Logs ReduceLROnPlateau's metric, one value of ``METRICS`` per step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("metric", METRICS[self.trainer.global_step])
        return super().training_step(batch, batch_idx)


class LearningRates(Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append([group["lr"] for group in trainer.optimizers[0].param_groups])


@pytest.mark.parametrize("name", TRAINER_SCHEDULERS)
def test_each_groups_lr_in_a_frozen_deepspeed_fit_is_plain_torchs(name: str) -> None:
    make = SCHEDULERS[name]
    reference_optimizer = torch.optim.SGD(_adapter_groups(AdapterModel()), lr=0.1)
    reference = make(reference_optimizer, 5)
    expected = []
    for step in range(TRAINER_STEPS):
        expected.append([group["lr"] for group in reference_optimizer.param_groups])
        reference_optimizer.step()
        _step(reference, step)

    def optimizer_fn(module: nn.Module) -> dict[str, Any]:
        optimizer = torch.optim.SGD(_adapter_groups(module), lr=0.1)
        config = {"scheduler": make(optimizer, 5), "interval": "step"}
        if name == "ReduceLROnPlateau":
            config["monitor"] = "metric"
        return {"optimizer": optimizer, "lr_scheduler": config}

    recorder = LearningRates()
    trainer = cpu_trainer(max_epochs=2, callbacks=[recorder])
    trainer.fit(PlateauMetric(optimizer_fn=optimizer_fn), regression_data())
    assert trainer.global_step == TRAINER_STEPS
    assert recorder.lrs == expected
    assert len({lrs[4] for lrs in expected}) > 1  # a trained group's lr moved, so the comparison compared something
