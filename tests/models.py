"""Small LightningModules the tests train: a frozen stack with a trainable low-rank adapter on each layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_frozen  # noqa: F401  (registers the "frozen_deepspeed" strategy names)
from tests.stock_cpu import CPUDeepSpeedStrategy as StockDeepSpeedOnCPU  # noqa: F401  (stock, CUDA checks lifted)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, the shape of a LoRA adapter."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.02)
        self.lora_b = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class AdapterModel(L.LightningModule):
    """``depth`` frozen linear layers, each with a LoRA adapter, and a trainable head.

    ``optimizer_fn(module) -> optimizer or Lightning's dict`` replaces the default AdamW over all params.
    """

    frozen_base_reference = "tests/adapter-model"

    def __init__(
        self,
        width: int = 32,
        depth: int = 2,
        rank: int = 4,
        lr: float = 1e-2,
        optimizer_fn: Optional[Callable[[L.LightningModule], Any]] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer_fn"])
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(LoRALinear(width, rank) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.lr = lr
        self.optimizer_fn = optimizer_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y.float()))

    def configure_optimizers(self) -> Any:
        if self.optimizer_fn is not None:
            return self.optimizer_fn(self)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def regression_data(width: int = 32, samples: int = 64, batch_size: int = 8, seed: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=generator)
    y = x[:, :1] * 0.5 - x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def cpu_trainer(strategy: Any = "frozen_deepspeed", devices: int = 1, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


class BackboneModel(L.LightningModule):
    """A ``backbone`` (two linear layers) and a trainable head, the layout ``BackboneFinetuning`` expects; the
    optimizer holds every param, or with ``trainable_only`` those that train when it is built (Lightning's advice)."""

    frozen_base_reference = "tests/backbone-model"

    def __init__(self, width: int = 16, lr: float = 0.01, seed: int = 0, trainable_only: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.backbone = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad or not self.hparams.trainable_only]
        return torch.optim.AdamW(params, lr=self.hparams.lr)
