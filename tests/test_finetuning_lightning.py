"""The behaviours Lightning's own finetuning-callback tests check
(``tests/tests_pytorch/callbacks/test_finetuning_callback.py``), under ``frozen_deepspeed`` on the CPU with
lightning_frozen's ``BaseFinetuning`` / ``BackboneFinetuning``. Where a Trainer runs, the same run under Lightning's
own callbacks on the default strategy is the reference: the same params trainable at each epoch, the same groups with
the same learning rates, the same weights."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning as LightningBackboneFinetuning
from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_frozen import BackboneFinetuning, BaseFinetuning
from tests.distributed import read_reports, run_script
from tests.models import cpu_trainer


def _data(samples: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 32, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :2] * 0.5), batch_size=4)


def _trainer(frozen: bool, **kwargs: Any) -> L.Trainer:
    """``frozen_deepspeed`` (ours), or Lightning's default strategy on the CPU (the reference); both read the
    batches in order (DeepSpeed's distributed sampler would shuffle them)."""
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in kwargs.get("callbacks", []))
    return cpu_trainer(
        strategy="frozen_deepspeed" if frozen else "auto",
        use_distributed_sampler=False,
        enable_checkpointing=checkpointing,
        **kwargs,
    )


def _full(param: nn.Parameter) -> torch.Tensor:
    import deepspeed

    if not hasattr(param, "ds_id"):
        return param.detach().clone()
    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


class Regression(L.LightningModule):
    frozen_base_reference = "tests/finetuning-lightning"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class Epochs(Callback):
    """Per epoch, right after the finetuning callback ran: trainable params, groups (by name) and their lrs."""

    def __init__(self) -> None:
        self.trainable: list[list[str]] = []
        self.groups: list[list[list[str]]] = []
        self.lrs: list[list[float]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        self.trainable.append([n for n, p in module.named_parameters() if p.requires_grad])
        groups = getattr(trainer.strategy, "param_group_names", None)
        if groups is None:
            groups = [[names[id(p)] for p in g["params"]] for g in trainer.optimizers[0].param_groups]
        self.groups.append([list(g) for g in groups])
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.weights.append({n: _full(p) for n, p in module.named_parameters()})


# ---------------------------------------------------------------------------------------- test_finetuning_callback


class BatchNormBackbone(Regression):
    """Lightning's ``FinetuningBoringModel``: a BatchNorm in the backbone, ``configure_optimizers`` names the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.backbone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


def _fit_bn_backbone(frozen: bool) -> tuple[Epochs, BatchNormBackbone]:
    callback_class = BackboneFinetuning if frozen else LightningBackboneFinetuning
    epochs = Epochs()
    module = BatchNormBackbone()
    trainer = _trainer(frozen, max_epochs=5, callbacks=[callback_class(unfreeze_backbone_at_epoch=1), epochs])
    trainer.fit(module, _data())
    return epochs, module


def test_backbone_with_batchnorm_and_train_bn_trains_as_under_lightning(lightning_log: Any) -> None:
    reference, _ = _fit_bn_backbone(frozen=False)
    ours, module = _fit_bn_backbone(frozen=True)
    # epoch 0: the BatchNorm params require grad (train_bn=True) in no group: never stepped, training goes on
    assert (
        ours.trainable[0]
        == reference.trainable[0]
        == ["backbone.1.weight", "backbone.1.bias", "layer.weight", "layer.bias"]
    )
    assert (
        "`backbone.1.weight`, `backbone.1.bias` require grad but are in no optimizer param group" in lightning_log.text
    )
    initial = BatchNormBackbone()
    for name in ("backbone.0.weight", "backbone.1.weight", "backbone.1.bias"):
        assert torch.equal(ours.weights[0][name], initial.state_dict()[name]), name
    assert not torch.equal(ours.weights[0]["layer.weight"], initial.layer.weight)
    # from epoch 1 the backbone (BatchNorm included) is a second group whose lr rises toward the head's, then aligns
    assert ours.groups == reference.groups
    assert ours.groups[1] == [
        ["layer.weight", "layer.bias"],
        ["backbone.0.weight", "backbone.1.weight", "backbone.1.bias"],
    ]
    assert ours.lrs == reference.lrs
    assert ours.lrs[1][1] == pytest.approx(0.1 * 0.7 * 0.1) and ours.lrs[4][1] == ours.lrs[4][0]
    assert ours.trainable == reference.trainable
    for epoch in range(5):
        for name, value in reference.weights[epoch].items():
            torch.testing.assert_close(ours.weights[epoch][name], value, msg=f"{name} after epoch {epoch}")
    # the BatchNorm in train mode moved its running statistics all along, as under Lightning
    assert not torch.equal(module.backbone[1].running_mean, initial.backbone[1].running_mean)


def test_a_checkpoint_taken_while_batchnorm_params_are_in_no_group_saves_and_resumes_exactly(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    straight = Epochs()
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), straight, checkpoint]
    _trainer(True, max_epochs=3, callbacks=callbacks).fit(BatchNormBackbone(), _data())
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    # the never-stepped BatchNorm params are saved as they are (trainable), outside the optimizer's groups
    initial = BatchNormBackbone()
    assert torch.equal(saved["state_dict"]["backbone.1.weight"], initial.backbone[1].weight.detach())
    assert [g["params"] for g in saved["optimizer_states"][0]["param_groups"]] == [["layer.weight", "layer.bias"]]

    resumed = Epochs()
    trainer = _trainer(True, max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), resumed])
    trainer.fit(BatchNormBackbone(), _data(), ckpt_path=tmp_path / "epoch=0.ckpt")
    assert resumed.groups == straight.groups[1:] and resumed.lrs == straight.lrs[1:]
    for name, value in straight.weights[-1].items():
        torch.testing.assert_close(resumed.weights[-1][name], value, msg=name)


# ------------------------------------------------------ test_freeze_unfreeze_function, test_complex_nested_model


def test_freeze_and_make_trainable_set_requires_grad_and_batchnorm_tracking() -> None:
    backbone = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    BaseFinetuning.freeze(backbone, train_bn=True)
    assert not backbone[0].weight.requires_grad and not backbone[3].weight.requires_grad
    assert backbone[1].weight.requires_grad and backbone[1].track_running_stats
    BaseFinetuning.freeze(backbone, train_bn=False)
    assert not backbone[1].weight.requires_grad and not backbone[1].track_running_stats
    BaseFinetuning.make_trainable(backbone)
    assert all(p.requires_grad for p in backbone.parameters()) and backbone[1].track_running_stats
    BaseFinetuning.freeze([backbone[1], [backbone[3]]], train_bn=True)
    assert backbone[1].weight.requires_grad and not backbone[3].weight.requires_grad


class ConvBlockParam(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.module_dict = nn.ModuleDict({"conv": nn.Conv2d(in_channels, out_channels, 3), "act": nn.ReLU()})
        self.parent_param = nn.Parameter(torch.zeros(1))
        self.bn = nn.BatchNorm2d(out_channels)


class ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3)
        self.act = nn.ReLU()
        self.bn = nn.BatchNorm2d(out_channels)


def test_flatten_modules_and_filter_params_reach_parent_params_of_nested_modules() -> None:
    model = nn.Sequential(
        OrderedDict([("encoder", nn.Sequential(ConvBlockParam(3, 4), ConvBlock(4, 8))), ("decoder", ConvBlock(8, 2))])
    )
    assert len(BaseFinetuning.flatten_modules(model)) == 10
    BaseFinetuning.freeze(model.encoder, train_bn=True)
    assert not model.encoder[0].module_dict["conv"].weight.requires_grad
    assert not model.encoder[0].parent_param.requires_grad
    assert model.encoder[0].bn.weight.requires_grad
    assert len(list(BaseFinetuning.filter_params(model.encoder, train_bn=True, requires_grad=False))) == 5
    BaseFinetuning.make_trainable(model)
    assert len(list(BaseFinetuning.filter_params(model.encoder, train_bn=True))) == 9
    assert len(list(BaseFinetuning.filter_params(model.encoder, train_bn=False))) == 5


# ------------------------------------------------------------------------ test_unfreeze_and_add_param_group_function


def test_unfreeze_and_add_param_group_adds_new_params_and_warns_about_present_ones() -> None:
    backbone = nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(5)), nn.BatchNorm1d(32))
    optimizer = torch.optim.SGD(backbone[0].parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="The provided params to be frozen already exist"):
        BaseFinetuning.unfreeze_and_add_param_group(backbone[0], optimizer=optimizer)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["lr"] == 0.01

    backbone[1].weight.requires_grad = False
    BaseFinetuning.unfreeze_and_add_param_group(backbone[1], optimizer=optimizer)
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[1]["lr"] == 0.001
    assert optimizer.param_groups[1]["params"] == [backbone[1].weight] and backbone[1].weight.requires_grad

    with pytest.warns(UserWarning, match=r"(?s)Did you init your optimizer in `configure_optimizer`.*SGD"):
        BaseFinetuning.unfreeze_and_add_param_group(backbone, optimizer=optimizer, lr=100, train_bn=False)
    assert len(optimizer.param_groups) == 3 and optimizer.param_groups[2]["lr"] == 100
    assert optimizer.param_groups[2]["params"] == [backbone[2].weight, backbone[3].weight, backbone[4].weight]


# ------------------------------------------- test_finetuning_callback_warning, in a Trainer under frozen_deepspeed


class AddBackboneAndHeadAtEpochZero(BackboneFinetuning):
    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 0:
            self.unfreeze_and_add_param_group([pl_module.backbone, pl_module.layer], optimizer, 0.1)


class LinearBackbone(Regression):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.backbone = nn.Linear(32, 32, bias=False)
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_adding_params_the_optimizer_already_holds_warns_in_a_trainer_and_skips_them() -> None:
    epochs = Epochs()
    trainer = _trainer(True, max_epochs=1, limit_train_batches=1, callbacks=[AddBackboneAndHeadAtEpochZero(), epochs])
    with pytest.warns(UserWarning, match=r"(?s)Did you init your optimizer in `configure_optimizer`.*SGD"):
        trainer.fit(LinearBackbone(), _data())
    assert epochs.groups[0] == [["layer.weight", "layer.bias"], ["backbone.weight"]]


# --------------------------------------------------------------------- test_base_finetuning_internal_optimizer_metadata


def _layer_per_epoch(base: type) -> type:
    class OnEpochLayerFinetuning(base):
        def freeze_before_training(self, pl_module: L.LightningModule) -> None:
            self.freeze(pl_module.layer)

        def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
            self.unfreeze_and_add_param_group(pl_module.layer[epoch], optimizer)

    return OnEpochLayerFinetuning


class Layers(Regression):
    """Lightning's ``FreezeModel`` with a head outside ``layer``: ``frozen_deepspeed`` needs something to train at
    setup, where Lightning's holds the frozen ``layer[0]`` in its optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.layer = nn.Sequential(*(nn.Linear(32, 32, bias=k % 2 == 1) for k in range(4)))
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_internal_optimizer_metadata_records_every_group_added_and_a_resume_continues_it(tmp_path: Path) -> None:
    metadata = {}
    for frozen in (False, True):
        callback = _layer_per_epoch(BaseFinetuning if frozen else LightningBaseFinetuning)()
        checkpoint = ModelCheckpoint(dirpath=tmp_path / str(frozen), save_last=True)
        _trainer(frozen, max_epochs=4, limit_train_batches=1, callbacks=[callback, checkpoint]).fit(Layers(), _data())
        metadata[frozen] = callback._internal_optimizer_metadata
    assert metadata[True] == metadata[False]
    assert [g["params"] for g in metadata[True][0]] == [
        ["head.weight", "head.bias"],
        ["layer.0.weight"],
        ["layer.1.weight", "layer.1.bias"],
        ["layer.2.weight"],
        ["layer.3.weight", "layer.3.bias"],
    ]
    assert [g["lr"] for g in metadata[True][0]] == [0.1, 0.01, 0.01, 0.01, 0.01]
    # the resumed callback finds its metadata and goes on where it stopped: at epoch 4 there is no layer 4
    saved = torch.load(tmp_path / "True" / "last.ckpt", weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if "OnEpochLayerFinetuning" in k)
    assert [g["params"] for g in state["internal_optimizer_metadata"][0]] == [g["params"] for g in metadata[True][0]]
    trainer = _trainer(True, max_epochs=6, limit_train_batches=1, callbacks=[_layer_per_epoch(BaseFinetuning)()])
    with pytest.raises(IndexError, match="index 4 is out of range"):
        trainer.fit(Layers(), _data(), ckpt_path=tmp_path / "True" / "last.ckpt")
    assert trainer.current_epoch == 4


# ---------------------------------------------------------------------------------------- test_callbacks_restore


class RestoreCallback(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.layer[:3])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch >= 1:
            self.unfreeze_and_add_param_group(pl_module.layer[epoch - 1], optimizer)


class FilteredLayers(Regression):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


def test_callback_state_is_restored_before_the_optimizer_state_and_training_continues(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callback = RestoreCallback()
    _trainer(True, max_epochs=2, limit_train_batches=1, callbacks=[callback, checkpoint]).fit(FilteredLayers(), _data())
    groups = callback._internal_optimizer_metadata[0]
    assert [g["params"] for g in groups] == [["layer.3.weight", "layer.3.bias"], ["layer.0.weight", "layer.0.bias"]]
    assert [g["lr"] for g in groups] == [0.1, 0.01]
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 and g["nesterov"] is False for g in groups)

    epochs = Epochs()
    resumed = RestoreCallback()
    trainer = _trainer(True, max_epochs=3, limit_train_batches=1, callbacks=[resumed, epochs])
    module = FilteredLayers()
    trainer.fit(module, _data(), ckpt_path=checkpoint.last_model_path)
    # epoch 2 starts from the two saved groups and adds layer 1 as a third
    assert epochs.groups == [
        [["layer.3.weight", "layer.3.bias"], ["layer.0.weight", "layer.0.bias"], ["layer.1.weight", "layer.1.bias"]]
    ]
    assert epochs.lrs == [[0.1, 0.01, 0.01]]
    assert [g["params"] for g in resumed._internal_optimizer_metadata[0]] == [
        ["layer.3.weight", "layer.3.bias"],
        ["layer.0.weight", "layer.0.bias"],
        ["layer.1.weight", "layer.1.bias"],
    ]
    assert not module.layer[2].weight.requires_grad and trainer.global_step == 3


# ------------------------------------------------------------ test_finetuning_with_configure_model (Lightning > 2.6)


class BuiltInConfigureModel(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.configure_model_calls = 0

    def configure_model(self) -> None:
        self.configure_model_calls += 1
        torch.manual_seed(42)
        self.backbone = nn.Linear(32, 32)
        self.classifier = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class FreezeBackbone(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        assert hasattr(pl_module, "backbone"), "backbone should be configured before freezing"
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        pass


def test_the_callback_freezes_a_model_built_in_configure_model_once_it_is_built() -> None:
    module = BuiltInConfigureModel()
    epochs = Epochs()
    trainer = _trainer(True, max_epochs=1, limit_train_batches=2, callbacks=[FreezeBackbone(), epochs])
    trainer.fit(module, _data())
    assert module.configure_model_calls == 1
    assert epochs.trainable == [["classifier.weight", "classifier.bias"]]
    assert epochs.groups == [[["classifier.weight", "classifier.bias"]]]
    torch.manual_seed(42)
    assert torch.equal(epochs.weights[0]["backbone.weight"], nn.Linear(32, 32).weight.detach())


@pytest.mark.slow
def test_batchnorm_params_in_no_group_on_two_ranks(tmp_path: Path) -> None:
    run_script("finetune_batchnorm.py", f"--report={tmp_path}")
    reports = read_reports(tmp_path)
    assert len(reports) == 2 and reports[0] == reports[1]
    report = reports[0]
    assert report["groups"] == [
        [["head.weight", "head.bias"]],
        [["head.weight", "head.bias"], ["backbone.0.weight", "backbone.1.weight", "backbone.1.bias"]],
    ]
    # never stepped during epoch 0 (BatchNorm's weight starts at ones), stepped once in the backbone's group
    assert report["bn_weight"][0] == [1.0] * 16 and report["bn_weight"][1] != [1.0] * 16
    assert report["global_step"] == 8
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    assert torch.equal(saved["state_dict"]["backbone.1.weight"], torch.ones(16))
    assert [g["params"] for g in saved["optimizer_states"][0]["param_groups"]] == [["head.weight", "head.bias"]]
