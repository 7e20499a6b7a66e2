"""LR schedulers when fully frozen param groups are dropped or groups are added mid-run: every kept group must get
exactly the learning rates torch gives it without the strategy. Plain torch and DeepSpeed schedulers, no Trainer."""

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

from lightning_frozen.errors import SchedulerGroupsError
from lightning_frozen.optim import schedulers
from lightning_frozen.optim.filtering import strip_frozen_params
from lightning_frozen.optim.schedulers import register_per_group_attributes, regroup_scheduler
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

# group layouts: T a group with trainable params, F a wholly frozen one (dropped by the strategy)
LAYOUTS = {"decay-then-frozen-no-decay": "TF", "frozen-then-trainable": "FT", "frozen-in-the-middle": "TFT"}


def _optimizer(layout: str) -> torch.optim.Optimizer:
    groups = []
    for k, kind in enumerate(layout):
        param = nn.Parameter(torch.ones(2), requires_grad=kind == "T")
        groups.append({"params": [param], "lr": 0.1 * (k + 1), "weight_decay": 0.01 if k == 0 else 0.0})
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _step(scheduler: Any, step: int) -> None:
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(METRICS[step])
    else:
        scheduler.step()


def _hyper(optimizer: torch.optim.Optimizer, groups: list[int]) -> list[tuple[float, float]]:
    return [(optimizer.param_groups[i]["lr"], optimizer.param_groups[i]["momentum"]) for i in groups]


def _trajectory(optimizer: torch.optim.Optimizer, scheduler: Any, groups: list[int]) -> list[Any]:
    seen = [_hyper(optimizer, groups)]
    for step in range(STEPS):
        optimizer.step()
        _step(scheduler, step)
        seen.append(_hyper(optimizer, groups))
    return seen


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_kept_groups_follow_torchs_own_trajectory_when_frozen_groups_are_dropped(name: str, layout: str) -> None:
    make = SCHEDULERS[name]
    reference_optimizer = _optimizer(layout)
    reference = make(reference_optimizer, len(layout))
    trainable = [i for i, kind in enumerate(layout) if kind == "T"]
    expected = _trajectory(reference_optimizer, reference, trainable)

    optimizer = _optimizer(layout)
    scheduler = make(optimizer, len(layout))
    report = strip_frozen_params(optimizer, scheduler)
    assert report.dropped_groups == [i for i, kind in enumerate(layout) if kind == "F"]
    assert _trajectory(optimizer, scheduler, list(range(len(trainable)))) == expected
    # the lr moved at all, so the comparison compared something (ReduceLROnPlateau and OneCycle included)
    assert len({lrs[0][0] for lrs in expected}) > 1


class PeakScheduler(lr_scheduler.LRScheduler):
    """A scheduler the package does not know: one peak per group, and a list of phases that is not per group."""

    def __init__(self, optimizer: torch.optim.Optimizer, peaks: list[float]) -> None:
        self.peaks = list(peaks)
        self.phases = [3, 100][: len(optimizer.param_groups)]
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        ramp = min(1.0, self.last_epoch / self.phases[0])
        return [base + (peak - base) * ramp for base, peak in zip(self.base_lrs, self.peaks)]


def test_an_unknown_scheduler_with_group_long_lists_is_refused_naming_them() -> None:
    optimizer = _optimizer("TF")
    scheduler = PeakScheduler(optimizer, [1.0, 2.0])
    with pytest.raises(
        SchedulerGroupsError, match=r"`PeakScheduler`.*`peaks`, `phases`.*register_per_group_attributes"
    ):
        strip_frozen_params(optimizer, scheduler)


def test_a_registered_scheduler_follows_torchs_trajectory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedulers, "_REGISTERED", dict(schedulers._REGISTERED))
    register_per_group_attributes(PeakScheduler, "peaks")
    reference_optimizer = _optimizer("FT")
    expected = _trajectory(reference_optimizer, PeakScheduler(reference_optimizer, [1.0, 2.0]), [1])
    optimizer = _optimizer("FT")
    scheduler = PeakScheduler(optimizer, [1.0, 2.0])
    strip_frozen_params(optimizer, scheduler)
    assert scheduler.phases == [3, 100] and scheduler.peaks == [2.0]
    assert _trajectory(optimizer, scheduler, [0]) == expected


def test_a_subclass_of_a_known_scheduler_with_a_list_of_its_own_is_refused() -> None:
    class Tagged(lr_scheduler.StepLR):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.tags = ["a", "b"]
            super().__init__(optimizer, step_size=2)

    optimizer = _optimizer("TF")
    with pytest.raises(SchedulerGroupsError, match="`Tagged`.*`tags`"):
        strip_frozen_params(optimizer, Tagged(optimizer))
    # without a list of its own it is the known class's knowledge that applies
    optimizer = _optimizer("TF")
    plain = type("Plain", (lr_scheduler.StepLR,), {})(optimizer, step_size=2)
    strip_frozen_params(optimizer, plain)
    assert plain.base_lrs == [0.1]


# schedulers with one shared value where they could have one per group, so that a group added mid-run can take it
SHARED: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.001),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.5, step_size_up=3),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o,
        [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3), lr_scheduler.ExponentialLR(o, gamma=0.7)],
        milestones=[3],
    ),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=0.01),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=STEPS + 1),
    "deepspeed-WarmupLR": lambda o: lr_schedules.WarmupLR(o, warmup_max_lr=0.3, warmup_num_steps=5),
}
# what a group added with lr 0.05 at step 4 must bring for OneCycleLR: the keys it reads from every group
ONE_CYCLE_KEYS = {"initial_lr": 0.02, "max_lr": 0.5, "min_lr": 0.02 / 1e4, "max_momentum": 0.95, "base_momentum": 0.85}


def _add_group_mid_run(name: str, extra: dict[str, Any]) -> tuple[list[Any], list[Any], list[float]]:
    """Run the reference and the stripped copy (a frozen group between two trainable ones) 4 steps, rebuild the
    stripped copy's optimizer with a new group as ``reconfigure_trainable`` does, and run both on."""
    make = SHARED[name]
    reference_optimizer = _optimizer("TFT")
    reference = make(reference_optimizer)
    optimizer = _optimizer("TFT")
    scheduler = make(optimizer)
    strip_frozen_params(optimizer, scheduler)
    expected, seen, added_lrs = [], [], []
    for step in range(STEPS):
        if step == 4:
            new_param = nn.Parameter(torch.ones(3))
            groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
            rebuilt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
            rebuilt.add_param_group({"params": [new_param], "lr": 0.05, **extra})
            regroup_scheduler(scheduler, rebuilt, kept=[0, 1], num_groups=2)
            optimizer = rebuilt
        for opt, sched in ((reference_optimizer, reference), (optimizer, scheduler)):
            opt.step()
            _step(sched, step)
        expected.append(_hyper(reference_optimizer, [0, 2]))
        seen.append(_hyper(optimizer, [0, 1]))
        if len(optimizer.param_groups) == 3:
            added_lrs.append(optimizer.param_groups[2]["lr"])
    return expected, seen, added_lrs


@pytest.mark.parametrize("name", list(SHARED))
def test_a_group_added_mid_run_leaves_the_kept_groups_on_torchs_trajectory(name: str) -> None:
    expected, seen, added_lrs = _add_group_mid_run(name, ONE_CYCLE_KEYS if name == "OneCycleLR" else {})
    assert seen == expected
    assert len(added_lrs) == STEPS - 4 and all(lr >= 0 for lr in added_lrs)


def test_a_group_added_under_a_shared_lambda_follows_it_from_its_own_lr() -> None:
    _, _, added_lrs = _add_group_mid_run("LambdaLR", {})
    assert added_lrs == [0.05 * 0.9 ** (step + 1) for step in range(4, STEPS)]


def test_a_group_added_under_one_cycle_without_its_peaks_is_refused_naming_them() -> None:
    with pytest.raises(
        SchedulerGroupsError,
        match=r"`OneCycleLR` reads `base_momentum`, `initial_lr`, `max_lr`, `max_momentum`, `min_lr`.*add_param_group",
    ):
        _add_group_mid_run("OneCycleLR", {})


def test_a_group_added_where_each_group_has_its_own_value_is_refused_naming_it() -> None:
    optimizer = _optimizer("TT")
    scheduler = SCHEDULERS["CyclicLR"](optimizer, 2)
    rebuilt = torch.optim.SGD(
        [{**g, "params": list(g["params"])} for g in optimizer.param_groups], lr=0.1, momentum=0.9
    )
    rebuilt.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": 0.05})
    with pytest.raises(SchedulerGroupsError, match="`CyclicLR` has a different `max_lrs` for each param group"):
        regroup_scheduler(scheduler, rebuilt, kept=[0, 1], num_groups=2)


def _decay_groups_with_one_cycle(module: nn.Module) -> dict[str, Any]:
    """Decay / no-decay groups as transformers' recipes build them; the no-decay group (the frozen base's biases) is
    wholly frozen, and OneCycleLR gives each group its own peak."""
    no_decay = [p for n, p in module.named_parameters() if n.endswith("base.bias")]
    decay = [p for n, p in module.named_parameters() if not n.endswith("base.bias")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01
    )
    scheduler = lr_scheduler.OneCycleLR(optimizer, max_lr=[0.05, 0.02], total_steps=16)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LearningRates(Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append([group["lr"] for group in trainer.optimizers[0].param_groups])


def test_one_cycle_over_a_dropped_no_decay_group_in_a_trainer_follows_torch() -> None:
    reference = _decay_groups_with_one_cycle(AdapterModel())
    expected = []
    for _ in range(16):
        expected.append([reference["optimizer"].param_groups[0]["lr"]])
        reference["optimizer"].step()
        reference["lr_scheduler"]["scheduler"].step()

    recorder = LearningRates()
    trainer = cpu_trainer(max_epochs=2, callbacks=[recorder])
    trainer.fit(AdapterModel(optimizer_fn=_decay_groups_with_one_cycle), regression_data())
    assert trainer.global_step == 16 and len(trainer.optimizers[0].param_groups) == 1
    assert recorder.lrs == expected
    # it climbed to near its peak and came down again: the phases the old length rule cut were both run
    assert max(lr for (lr,) in expected) > 0.049 and expected[-1][0] < 0.01
