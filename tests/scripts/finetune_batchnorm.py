"""BackboneFinetuning(train_bn=True) over a backbone with BatchNorm under ``frozen_deepspeed`` on 2 CPU processes: the
BatchNorm params require grad in no group during epoch 0 (a checkpoint is taken then), and join the backbone's group
at epoch 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import lightning_frozen  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import cpu_trainer, regression_data  # noqa: E402


class BatchNormBackbone(L.LightningModule):
    frozen_base_reference = "tests/batchnorm-backbone"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class Snapshots(Callback):
    def __init__(self) -> None:
        self.groups: list[list[list[str]]] = []
        self.bn_weight: list[list[float]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.groups.append([list(g) for g in trainer.strategy.param_group_names])

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        with deepspeed.zero.GatheredParameters([module.backbone[1].weight]):
            self.bn_weight.append(module.backbone[1].weight.detach().tolist())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    out = Path(args.report)
    snapshots = Snapshots()
    checkpoints = ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = cpu_trainer(
        devices=2, max_epochs=2, callbacks=[finetuning, snapshots, checkpoints], enable_checkpointing=True
    )
    trainer.fit(BatchNormBackbone(), regression_data(width=16))
    report = {"groups": snapshots.groups, "bn_weight": snapshots.bn_weight, "global_step": trainer.global_step}
    write_report(out, trainer.global_rank, report)


if __name__ == "__main__":
    main()
