"""The DeepSpeed config that runs is the one truth (issue 18): the same checkpoint round trips whether the strategy's
arguments built the config or ``config=`` gave it (a dict without the keys DeepSpeed treats as optional, or a JSON
file); the stage, the offloads and the bucket sizing are read from it; a stage other than 3 is refused from any
source, with the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy, InvalidArgumentValueError
from lightning_frozen.zero.config import zero_settings
from tests.models import AdapterModel, cpu_trainer, regression_data

# what a user writes: no `zero_allow_untested_optimizer`, no bucket sizes
USER_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 8}
FORMS = ("arguments", "dict", "json")
TRAINABLE = 545  # AdapterModel's trainable elements


def _strategy(form: str, folder: Path) -> FrozenAwareDeepSpeedStrategy:
    if form == "arguments":
        return FrozenAwareDeepSpeedStrategy()
    if form == "dict":
        return FrozenAwareDeepSpeedStrategy(config=json.loads(json.dumps(USER_CONFIG)))
    path = folder / "deepspeed.json"
    path.write_text(json.dumps(USER_CONFIG))
    return FrozenAwareDeepSpeedStrategy(config=str(path))


class _Predicting(AdapterModel):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


@pytest.fixture(scope="module", params=FORMS)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two steps under each form of config, and the checkpoint they save."""
    folder = tmp_path_factory.mktemp(request.param)
    trainer = cpu_trainer(_strategy(request.param, folder), max_steps=2, max_epochs=-1)
    model = _Predicting()
    trainer.fit(model, regression_data(samples=8))
    trainer.save_checkpoint(folder / "adapter.ckpt")
    engine_optimizer = trainer.strategy.deepspeed_engine.optimizer
    return {"form": request.param, "folder": folder, "model": model, "bucket": engine_optimizer.reduce_bucket_size}


def test_the_reduce_bucket_is_fitted_when_the_config_sets_no_size(trained: dict[str, Any]) -> None:
    assert trained["bucket"] == TRAINABLE


@pytest.mark.parametrize("entry", ["fit", "validate", "test", "predict", "load_from_checkpoint"])
def test_every_entry_point_reads_the_checkpoint_under_this_config(trained: dict[str, Any], entry: str) -> None:
    checkpoint = trained["folder"] / "adapter.ckpt"
    if entry == "load_from_checkpoint":
        loaded = lightning_frozen.load_from_checkpoint(_Predicting, checkpoint)
        expected = {n: p for n, p in trained["model"].named_parameters() if p.requires_grad}
        saved = torch.load(checkpoint, weights_only=True)["state_dict"]
        assert saved.keys() == expected.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded.get_parameter(name), value, rtol=0, atol=0)
        return
    trainer = cpu_trainer(_strategy(trained["form"], trained["folder"]), max_steps=3, max_epochs=-1)
    model, data = _Predicting(), regression_data(samples=8)
    if entry == "fit":
        trainer.fit(model, data, ckpt_path=checkpoint)
        assert trainer.global_step == 3
    elif entry == "predict":
        predictions = trainer.predict(model, data, ckpt_path=checkpoint)
        reference = lightning_frozen.load_from_checkpoint(_Predicting, checkpoint)
        with torch.no_grad():
            torch.testing.assert_close(predictions[0], reference(next(iter(data))[0]))
    else:
        metrics = getattr(trainer, entry)(model, data, ckpt_path=checkpoint)
        assert metrics and metrics[0][f"{'val' if entry == 'validate' else 'test'}_loss"] > 0


@pytest.mark.parametrize(
    "source, found",
    [
        (dict(stage=2), "`stage=2`"),
        (dict(zero_optimization=False), "the strategy's arguments sets ZeRO switched off"),
        (dict(config={"zero_optimization": {"stage": 2}}), "the DeepSpeed config .* sets ZeRO stage 2"),
        (dict(config={"train_micro_batch_size_per_gpu": 1}), "the DeepSpeed config .* sets ZeRO switched off"),
        (dict(config={"zero_optimization": True}), "the DeepSpeed config .* sets ZeRO stage 1"),
        ("json", "the DeepSpeed config .* sets ZeRO stage 1"),
    ],
)
def test_a_stage_other_than_3_is_refused_from_every_source(source: Any, found: str, tmp_path: Path) -> None:
    if source == "json":
        path = tmp_path / "stage1.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
        source = dict(config=str(path))
    with pytest.raises(InvalidArgumentValueError, match=found):
        FrozenAwareDeepSpeedStrategy(**source)


def test_offloads_pinning_and_bucket_sizing_are_read_from_the_config(tmp_path: Path) -> None:
    offload = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "reduce_bucket_size": 1000}
    strategy = FrozenAwareDeepSpeedStrategy(config={"zero_optimization": offload})
    assert strategy.offload_optimizer and strategy.pin_memory
    assert not zero_settings(strategy.config).fit_reduce_bucket
    # the arguments say otherwise, the config decides
    strategy = FrozenAwareDeepSpeedStrategy(offload_optimizer=True, pin_memory=True, config=USER_CONFIG)
    assert not strategy.offload_optimizer and not strategy.pin_memory
    switched_off = {"offload_optimizer": {"device": "none"}, "offload_param": {"device": "none", "pin_memory": True}}
    no_offload = zero_settings({"zero_optimization": {"stage": 3, **switched_off}})
    assert no_offload == zero_settings({"zero_optimization": {"stage": 3}})
    assert not no_offload.offload_param and not no_offload.pin_memory
    assert FrozenAwareDeepSpeedStrategy(pin_memory=True).pin_memory  # frozen shards: the package's own offload
