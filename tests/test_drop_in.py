"""``FrozenAwareDeepSpeedStrategy`` in place of Lightning's ``DeepSpeedStrategy`` at stage 3: what stock does that
applies on the CPU holds here too (one process, real DeepSpeed on its CPU accelerator)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.errors import InvalidArgumentValueError

ENV = DeepSpeedStrategy.DEEPSPEED_ENV_VAR


def _parameters(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


# ---------------------------------------------------------------------------------------------- arguments


def test_stocks_parameters_come_first_in_its_order_and_ours_are_keyword_only() -> None:
    stock, ours = _parameters(DeepSpeedStrategy), _parameters(FrozenAwareDeepSpeedStrategy)
    assert [p.name for p in ours[: len(stock)]] == [p.name for p in stock]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ours[: len(stock)])
    differ = {p.name for p, q in zip(stock, ours) if p.default != q.default}
    assert differ == {"stage"}  # 3 here, 2 there
    assert {p.kind for p in ours[len(stock) :]} == {inspect.Parameter.KEYWORD_ONLY}

    strategy = FrozenAwareDeepSpeedStrategy(None, True, 3, "cpu", True)
    assert strategy.remote_device == "cpu" and strategy.offload_optimizer and strategy.offload_frozen
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_a_misspelt_keyword_names_this_class() -> None:
    with pytest.raises(TypeError, match=r"^FrozenAwareDeepSpeedStrategy\.__init__\(\) got an unexpected .* 'stag'"):
        FrozenAwareDeepSpeedStrategy(stag=3)


# ---------------------------------------------------------------------------------------------- the config


def _write(path: Path, config: dict) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_the_config_from_the_environment_variable_is_read_and_a_stage_other_than_3_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage_3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 4321}, "train_micro_batch_size_per_gpu": 2}
    monkeypatch.setenv(ENV, _write(tmp_path / "stage3.json", stage_3))
    assert FrozenAwareDeepSpeedStrategy().config == stage_3

    stage_2 = _write(tmp_path / "stage2.json", {"zero_optimization": {"stage": 2}})
    monkeypatch.setenv(ENV, stage_2)
    with pytest.raises(InvalidArgumentValueError, match=rf"config file {stage_2} \(from `{ENV}`\) sets ZeRO stage 2"):
        FrozenAwareDeepSpeedStrategy()
    # `config=` wins over the variable, as in stock
    assert FrozenAwareDeepSpeedStrategy(config=stage_3).config["zero_optimization"]["reduce_bucket_size"] == 4321
