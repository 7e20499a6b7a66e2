"""The strategy in one process: real Lightning Trainers, real DeepSpeed ZeRO-3 on its CPU accelerator."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.errors import (
    ForeignParametersError,
    FrozenSetChangedError,
    NoTrainableParametersError,
    UnsupportedOffloadOptimizerError,
)
from tests.models import AdapterModel, cpu_trainer, regression_data


def _trainable_numel(model: L.LightningModule) -> int:
    return sum(p.ds_numel for p in model.parameters() if p.requires_grad)


def _fp32_partition_numel(trainer: L.Trainer) -> int:
    return sum(flat.numel() for flat in trainer.strategy.deepspeed_engine.optimizer.fp32_partitioned_groups_flat)


def _full(param: torch.nn.Parameter) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def test_strategy_names_are_registered_with_their_defaults() -> None:
    for name in ("frozen_deepspeed", "frozen_deepspeed_offload", "frozen_deepspeed_no_offload"):
        assert name in StrategyRegistry, name
    trainer = cpu_trainer("frozen_deepspeed")
    strategy = trainer.strategy
    assert isinstance(strategy, FrozenAwareDeepSpeedStrategy) and isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.offload_frozen and not strategy.offload_optimizer
    assert cpu_trainer("frozen_deepspeed_offload").strategy.offload_optimizer
    assert not cpu_trainer("frozen_deepspeed_no_offload").strategy.offload_frozen
    assert lightning_frozen.FrozenAwareDeepSpeedStrategy is FrozenAwareDeepSpeedStrategy


def test_stock_arguments_keep_working_and_stage_must_be_three() -> None:
    strategy = FrozenAwareDeepSpeedStrategy(reduce_bucket_size=1234, logging_batch_size_per_gpu=3)
    assert strategy.config["zero_optimization"]["reduce_bucket_size"] == 1234
    assert strategy.config["train_micro_batch_size_per_gpu"] == 3
    with pytest.raises(ValueError, match="stage 3.*stage=2"):
        FrozenAwareDeepSpeedStrategy(stage=2)
    with pytest.raises(ValueError, match="fingerprint"):
        FrozenAwareDeepSpeedStrategy(fingerprint="md5")


def test_fit_trains_only_the_adapter_and_frozen_params_are_cpu_shards(lightning_log: Any) -> None:
    model = AdapterModel()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = cpu_trainer(max_steps=3)
    trainer.fit(model, regression_data())

    assert _fp32_partition_numel(trainer) == _trainable_numel(model) == 545
    for name, param in model.named_parameters():
        assert param.grad is None, name
        if param.requires_grad:
            continue
        # a frozen param is a 1/1 shard, in CPU memory, released (empty) outside forward
        assert param.ds_tensor.numel() == math.ceil(param.ds_numel / 1)
        assert param.ds_tensor.device.type == "cpu" and param.data.numel() == 0
        assert torch.equal(_full(param), before[name]), f"frozen {name} changed"
    assert not torch.equal(_full(model.layers[0].lora_b), before["layers.0.lora_b"])
    assert "545 trainable / 2,112 frozen params" in lightning_log.text
    assert "the `lr=0` workaround would have added" in lightning_log.text


def _lr_zero_optimizer(module: L.LightningModule) -> torch.optim.Optimizer:
    frozen = [p for n, p in module.named_parameters() if ".base." in n]
    adapter = [p for n, p in module.named_parameters() if ".base." not in n]
    return torch.optim.Adam([{"params": frozen, "lr": 0.0}, {"params": adapter, "lr": 1e-2}])


def _unfrozen_adapter_model(**kwargs: Any) -> AdapterModel:
    model = AdapterModel(optimizer_fn=_lr_zero_optimizer, **kwargs)
    model.requires_grad_(True)  # the old workaround: nothing frozen, an lr=0 group instead
    return model


def test_lr_zero_workaround_is_frozen_with_a_notice_and_its_group_kept(lightning_log: Any) -> None:
    model = _unfrozen_adapter_model()
    before = model.layers[0].base.weight.detach().clone()
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(model, regression_data())
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".base." in n)
    assert _fp32_partition_numel(trainer) == 545
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.0, 0.01]  # DeepSpeed left the frozen one out
    assert torch.equal(_full(model.layers[0].base.weight), before)
    notices = [line for line in lightning_log.lines if line.startswith("lightning-frozen: froze ")]
    assert len(notices) == 1 and "froze 4 parameter tensors (2,112 elements)" in notices[0]


def test_lr_zero_conversion_can_be_turned_off() -> None:
    model = _unfrozen_adapter_model()
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(convert_lr_zero_groups=False), max_steps=1)
    trainer.fit(model, regression_data())
    assert all(p.requires_grad for p in model.parameters())
    assert _fp32_partition_numel(trainer) == 545 + 2112


class _WarmupModel(AdapterModel):
    """Three groups (one all frozen) with per-group LambdaLR lambdas, warm-up from lr 0."""

    def configure_optimizers(self) -> Any:
        groups = [
            {"params": [p for n, p in self.named_parameters() if ".base." in n], "lr": 5.0},
            {"params": [p for n, p in self.named_parameters() if "lora" in n], "lr": 0.1},
            {"params": list(self.head.parameters()), "lr": 0.01},
        ]
        optimizer = torch.optim.SGD(groups, lr=1.0, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, [lambda s: 100.0, lambda s: min(1.0, s / 4), lambda s: 0.5 * min(1.0, s / 2)]
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_warmup_from_zero_is_not_frozen_and_each_group_keeps_its_lambda(lightning_log: Any) -> None:
    model = _WarmupModel()
    before = model.head.weight.detach().clone()
    trainer = cpu_trainer(max_steps=3)
    trainer.fit(model, regression_data())
    groups = trainer.optimizers[0].param_groups
    assert [g["lr"] for g in groups] == pytest.approx([500.0, 0.1 * 3 / 4, 0.01 * 0.5])  # group 0 frozen
    assert [g["momentum"] for g in groups] == [0.9, 0.9, 0.9]
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [5.0, 0.1, 0.01]
    assert not torch.equal(_full(model.head.weight), before)
    assert not any(line.startswith("lightning-frozen: froze ") for line in lightning_log.lines)


def test_no_trainable_params_is_refused_before_deepspeed_starts() -> None:
    model = AdapterModel()
    model.requires_grad_(False)
    trainer = cpu_trainer()
    with pytest.raises(NoTrainableParametersError, match="AdapterModel.*none requires grad"):
        trainer.fit(model, regression_data())
    assert not hasattr(model.head.weight, "ds_id")


def test_optimizer_over_frozen_params_only_is_refused() -> None:
    model = AdapterModel(optimizer_fn=lambda m: torch.optim.SGD(m.layers[0].base.parameters(), lr=0.1))
    with pytest.raises(NoTrainableParametersError, match="holds only frozen parameters"):
        cpu_trainer().fit(model, regression_data())


def test_optimizer_over_foreign_params_is_refused() -> None:
    stray = torch.nn.Parameter(torch.zeros(5, 5))
    model = AdapterModel(optimizer_fn=lambda m: torch.optim.SGD([*m.head.parameters(), stray], lr=0.1))
    with pytest.raises(ForeignParametersError, match=r"\(5, 5\)"):
        cpu_trainer().fit(model, regression_data())
    assert not hasattr(model.head.weight, "ds_id")


class _FlipsDuringTraining(AdapterModel):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.layers[1].base.weight.requires_grad_(True)


def test_unfreezing_mid_run_without_a_finetuning_callback_is_detected() -> None:
    with pytest.raises(FrozenSetChangedError, match=r"unfrozen `layers\.1\.base\.weight`"):
        cpu_trainer(max_steps=4).fit(_FlipsDuringTraining(), regression_data())


def test_quantized_frozen_weights_on_cpu_are_refused() -> None:
    strategy = FrozenAwareDeepSpeedStrategy(
        config={"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}
    )
    with pytest.raises(RuntimeError, match="zero_quantized_nontrainable_weights.*CUDA kernels"):
        cpu_trainer(strategy).fit(AdapterModel(), regression_data())


def test_deepspeed_accelerator_follows_lightning_or_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA cannot run here: DeepSpeed's CUDA accelerator object stands in for a GPU machine's auto-detection.
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    cuda = CUDA_Accelerator()
    set_accelerator(cuda)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="CPUAccelerator.*DS_ACCELERATOR=cuda"):
        cpu_trainer().fit(AdapterModel(), regression_data())
    monkeypatch.delenv("DS_ACCELERATOR")
    during = []
    model = AdapterModel()
    model.on_train_start = lambda: during.append(get_accelerator()._name)  # type: ignore[method-assign]
    cpu_trainer(max_steps=1).fit(model, regression_data())
    assert during == ["cpu"]
    assert get_accelerator() is cuda  # the process's own again after the run


@pytest.mark.slow
def test_optimizer_offload_turns_adam_into_cpu_adam() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = AdapterModel(optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01))
    before = model.head.weight.detach().clone()
    trainer = cpu_trainer("frozen_deepspeed_offload", max_steps=2)
    trainer.fit(model, regression_data())
    inner = trainer.strategy.deepspeed_engine.optimizer.optimizer
    assert isinstance(inner, DeepSpeedCPUAdam)
    assert inner.param_groups[0]["lr"] == 0.05 and inner.param_groups[0]["weight_decay"] == 0.01
    assert _fp32_partition_numel(trainer) == 545
    assert not torch.equal(_full(model.head.weight), before)


def test_optimizer_offload_refuses_other_optimizers() -> None:
    model = AdapterModel(optimizer_fn=lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01))
    with pytest.raises(UnsupportedOffloadOptimizerError, match="RMSprop"):
        cpu_trainer("frozen_deepspeed_offload").fit(model, regression_data())


def test_bf16_frozen_shards_are_stored_in_the_compute_dtype() -> None:
    model = AdapterModel()
    trainer = cpu_trainer(precision="bf16-mixed", max_steps=2)
    trainer.fit(model, regression_data())
    for name, param in model.named_parameters():
        assert param.ds_tensor.dtype == torch.bfloat16, name
    assert all(
        flat.dtype == torch.float32 for flat in trainer.strategy.deepspeed_engine.optimizer.fp32_partitioned_groups_flat
    )


class _BucketSizes(Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        buckets = trainer.strategy.deepspeed_engine.optimizer.ipg_buckets.values()
        self.numels = [bucket.buffer.numel() for bucket in buckets]


def test_the_gradient_reduce_bucket_is_sized_to_the_trainable_params() -> None:
    # ZeRO-3 allocates the bucket whole: Lightning's default of 2e8 elements would be 763 MiB of fp32 here
    sizes = _BucketSizes()  # read during the run: the engine's teardown releases its buckets
    trainer = cpu_trainer(max_steps=1, callbacks=[sizes])
    trainer.fit(AdapterModel(), regression_data())
    assert sizes.numels == [545]
    chosen = cpu_trainer(FrozenAwareDeepSpeedStrategy(reduce_bucket_size=1000), max_steps=1)
    chosen.fit(AdapterModel(), regression_data())
    assert chosen.strategy.deepspeed_engine.optimizer.reduce_bucket_size == 1000


def test_setting_up_the_cpu_world_seeds_again_as_lightnings_deepspeed_strategy_does() -> None:
    drawn: list[torch.Tensor] = []

    class Draw(Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            drawn.append(torch.rand(4))  # after `setup_distributed`, before anything else draws

    L.seed_everything(5)
    expected = torch.rand(4)
    L.seed_everything(5)
    torch.rand(4)  # the generator moved on before the run, as a user's own code would move it
    cpu_trainer(max_steps=1, callbacks=[Draw()]).fit(AdapterModel(), regression_data())
    assert torch.equal(drawn[0], expected)
