"""Progressive unfreezing under ZeRO-3 with lightning_frozen's BaseFinetuning / BackboneFinetuning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_frozen
from lightning_frozen.zero import params
from tests.distributed import read_reports, run_script
from tests.models import BackboneModel, cpu_trainer, regression_data


def _data() -> Any:
    return regression_data(width=16)


def _full(param: torch.nn.Parameter) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


class Recorder(Callback):
    """Snapshots full weights and the head's optimizer state at epoch ends and right after each epoch start."""

    def __init__(self) -> None:
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self.head_state: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, list[list[str]]] = {}
        self.fp32_numel: dict[str, int] = {}

    def _snap(self, trainer: L.Trainer, module: L.LightningModule, when: str) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        self.weights[when] = {n: _full(p) for n, p in module.named_parameters()}
        self.head_state[when] = params.optimizer_state_of(optimizer, module.head.weight)
        self.groups[when] = [list(g) for g in trainer.strategy.param_group_names]
        self.fp32_numel[when] = sum(f.numel() for f in optimizer.fp32_partitioned_groups_flat)

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._snap(trainer, module, f"start{trainer.current_epoch}")

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._snap(trainer, module, f"end{trainer.current_epoch}")


class UnfreezeFirstLayerThenFreeze(lightning_frozen.BaseFinetuning):
    """Freezes the backbone; unfreezes its first layer at epoch 1 (lr 0.003) and freezes it again at epoch 2."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone[0], optimizer, lr=0.003)
        if epoch == 2:
            self.freeze(pl_module.backbone[0])


def test_backbone_finetuning_unfreezes_at_its_epoch_with_its_learning_rate() -> None:
    recorder = Recorder()
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.005)
    trainer = cpu_trainer(max_epochs=2, callbacks=[finetuning, recorder])
    module = BackboneModel(trainable_only=True)
    trainer.fit(module, _data())
    # epoch 0: only the head trains; the backbone is bit-identical and has no optimizer state
    assert recorder.fp32_numel["end0"] == 17 and recorder.groups["end0"] == [["head.weight", "head.bias"]]
    for name, value in recorder.weights["start0"].items():
        if name.startswith("backbone"):
            assert torch.equal(recorder.weights["end0"][name], value), name
    # epoch 1: the backbone is a second group at the callback's learning rate, and it trains
    assert recorder.fp32_numel["start1"] == 17 + 544
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.01, 0.005]
    assert not torch.equal(
        recorder.weights["end1"]["backbone.0.weight"], recorder.weights["start1"]["backbone.0.weight"]
    )
    # the head's optimizer state carried over the rebuild unchanged
    for key, value in recorder.head_state["end0"].items():
        torch.testing.assert_close(recorder.head_state["start1"][key], value)


def test_an_unfrozen_param_already_in_a_group_trains_there_as_under_lightning() -> None:
    recorder = Recorder()
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.005)
    trainer = cpu_trainer(max_epochs=2, callbacks=[finetuning, recorder])
    with pytest.warns(UserWarning, match="already exist within another group"):
        trainer.fit(BackboneModel(), _data())  # `configure_optimizers` names every param, the frozen backbone too
    everything = ["backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias", "head.weight"]
    assert recorder.groups["end0"] == recorder.groups["start1"] == [[*everything, "head.bias"]]
    assert recorder.fp32_numel["end0"] == 17 and recorder.fp32_numel["start1"] == 17 + 544
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.01]
    assert not torch.equal(
        recorder.weights["end1"]["backbone.2.weight"], recorder.weights["start1"]["backbone.2.weight"]
    )


def test_partial_unfreeze_then_freeze_again() -> None:
    recorder = Recorder()
    trainer = cpu_trainer(max_epochs=3, callbacks=[UnfreezeFirstLayerThenFreeze(), recorder])
    trainer.fit(BackboneModel(trainable_only=True), _data())
    start, end = recorder.weights["start0"], recorder.weights["end2"]
    # the layer never unfrozen is bit-identical throughout and never held optimizer state
    for name in ("backbone.2.weight", "backbone.2.bias"):
        assert torch.equal(end[name], start[name]), name
        assert all(name not in group for groups in recorder.groups.values() for group in groups)
    # epoch 1 trains the first layer at lr 0.003 ...
    assert recorder.groups["start1"] == [["head.weight", "head.bias"], ["backbone.0.weight", "backbone.0.bias"]]
    assert not torch.equal(
        recorder.weights["end1"]["backbone.0.weight"], recorder.weights["start1"]["backbone.0.weight"]
    )
    # ... and epoch 2 froze it again: its group stays (as in plain torch), but it released its state and stopped
    assert recorder.groups["start2"] == recorder.groups["start1"] and recorder.fp32_numel["start2"] == 17
    assert torch.equal(end["backbone.0.weight"], recorder.weights["end1"]["backbone.0.weight"])
    assert not end["head.weight"].equal(recorder.weights["end1"]["head.weight"])


def _finetune(tmp: Path, name: str, max_epochs: int, resume: Path | None = None) -> Path:
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.005)
    trainer = cpu_trainer(max_epochs=max_epochs, callbacks=[finetuning])
    trainer.fit(BackboneModel(trainable_only=True), _data(), ckpt_path=resume)
    path = tmp / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_a_checkpoint_after_unfreezing_resumes_with_the_same_trainable_set(tmp_path: Path) -> None:
    two = _finetune(tmp_path, "two", 2)
    saved = torch.load(two, weights_only=True)
    assert "backbone.0.weight" in saved["state_dict"]
    assert [g["params"] for g in saved["optimizer_states"][0]["param_groups"]][1][0] == "backbone.0.weight"
    # the fingerprint covers only what is still frozen: here nothing
    assert saved["frozen_base"]["fingerprint"]["tensors"] == {}

    straight = torch.load(_finetune(tmp_path, "straight", 3), weights_only=True)
    resumed = torch.load(_finetune(tmp_path, "resumed", 3, resume=two), weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 24
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value)
    # a model loaded for use takes the trained backbone from the checkpoint
    module = lightning_frozen.load_adapter(BackboneModel(), tmp_path / "resumed.ckpt")
    torch.testing.assert_close(module.backbone[0].weight, straight["state_dict"]["backbone.0.weight"])


def test_lightning_finetuning_callbacks_are_still_refused_with_a_pointer() -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    with pytest.raises(NotImplementedError, match="`BackboneFinetuning` refuses.*from `lightning_frozen`"):
        cpu_trainer(max_epochs=1, callbacks=[BackboneFinetuning()]).fit(BackboneModel(), _data())


@pytest.mark.slow
def test_unfreezing_on_two_ranks(tmp_path: Path) -> None:
    run_script("finetune_backbone.py", f"--report={tmp_path}")
    reports = read_reports(tmp_path)
    assert len(reports) == 2
    for report in reports:
        assert report["groups"] == [
            ["head.weight", "head.bias"],
            ["backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias"],
        ]
        assert report["backbone_changed"] and report["global_step"] == 12
    # left to interpreter shutdown, gloo's threads can abort a run that succeeded (status 134)
    assert {p.name: p.read_text() for p in tmp_path.glob("exit*.txt")} == {
        "exit0.txt": "destroyed",
        "exit1.txt": "destroyed",
    }
