"""The strategy's one resolved spec (``lightning_frozen/spec.py``): built once at construction from the arguments and
the DeepSpeed config that runs, frozen, kept through a fit, and read back through the strategy's public attributes."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from tests.models import AdapterModel, cpu_trainer, regression_data


def test_the_spec_holds_the_resolved_arguments_and_cannot_change() -> None:
    strategy = FrozenAwareDeepSpeedStrategy(
        offload_frozen=False, fingerprint="sha256", frozen_dtype="int8", frozen_base="org/base", preemption_grace=5.0
    )
    spec = strategy.spec
    assert (spec.stage, spec.offload_frozen, spec.fingerprint, spec.frozen_dtype) == (3, False, "sha256", "int8")
    assert (spec.frozen_base, spec.preemption_grace, spec.offload_optimizer, spec.fit_reduce_bucket) == (
        "org/base",
        5.0,
        False,
        True,
    )
    # the public attributes are views of the spec, not copies that could drift from it
    assert (strategy.offload_frozen, strategy.fingerprint, strategy.frozen_dtype) == (False, "sha256", "int8")
    assert strategy.frozen_base == "org/base" and strategy.convert_lr_zero_groups and strategy.return_freed_memory
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.offload_frozen = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        strategy.fingerprint = "none"  # type: ignore[misc]
    assert strategy.spec is spec and spec.with_frozen_dtype("int8") is spec
    assert spec.with_frozen_dtype("nf4").frozen_dtype == "nf4" and spec.frozen_dtype == "int8"


def test_the_deepspeed_config_given_decides_the_zero_fields() -> None:
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "reduce_bucket_size": 1000,
        },
        "train_micro_batch_size_per_gpu": 1,
    }
    spec = FrozenAwareDeepSpeedStrategy(config=config, pin_memory=False).spec
    assert spec.offload_optimizer and spec.pin_memory and not spec.offload_param and not spec.fit_reduce_bucket


def test_a_fit_keeps_the_spec_it_was_built_with() -> None:
    strategy = FrozenAwareDeepSpeedStrategy()
    spec = strategy.spec
    cpu_trainer(strategy, max_steps=2).fit(AdapterModel(), regression_data())
    assert strategy.spec is spec  # resolved once: nothing copied back or rebuilt during setup
