"""LoRA adapters on the tiny Llama, trained at once (a sweep) or one alone the plain PEFT way, for the tests of
``lightning_frozen.adapters``: same base, same data, each adapter from its own seed."""

from __future__ import annotations

from typing import Any

import lightning as L
import peft
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_frozen import adapters
from tests.peft_models import tiny_llama

# per adapter: LoRA rank, seed of its init, AdamW hyper-parameters, warm-up steps of its LambdaLR
SPECS: dict[str, dict[str, Any]] = {
    "x": dict(r=2, seed=11, lr=2e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup=1),
    "y": dict(r=4, seed=12, lr=5e-2, weight_decay=0.1, betas=(0.8, 0.99), warmup=3),
    "z": dict(r=8, seed=13, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95), warmup=2),
}

# every step clips (each adapter's norm is far above it), so one norm shared by the adapters would change their steps
FIT = dict(max_epochs=2, gradient_clip_val=0.05, accumulate_grad_batches=2)


def lora_config(name: str) -> peft.LoraConfig:
    spec = SPECS[name]
    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=spec["r"],
        lora_alpha=2 * spec["r"],
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
    )


def peft_with_adapters(llama_folder: str, names: list[str]) -> Any:
    """The tiny Llama with one LoRA adapter per name, each initialised from its own seed (as a lone run would)."""
    model: Any = None
    for name in names:
        torch.manual_seed(SPECS[name]["seed"])
        if model is None:
            model = peft.get_peft_model(tiny_llama(llama_folder), lora_config(name), adapter_name=name)
        else:
            model.add_adapter(name, lora_config(name))
    return model


def _warmup(steps: int) -> Any:
    return lambda step: min(1.0, (step + 1) / steps)


class CausalAdapters(L.LightningModule):
    """Next-token cross-entropy on the tiny Llama with LoRA adapters ``names``: with ``together``, all of them in one
    batch through ``lightning_frozen.adapters``; else exactly one adapter, the plain PEFT way."""

    def __init__(
        self,
        llama_folder: str,
        names: list[str],
        together: bool = True,
        in_configure_model: bool = False,
        checkpointing: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        assert together or len(names) == 1
        self.model: Any = None if in_configure_model else self._build()

    def _build(self) -> Any:
        model = peft_with_adapters(self.hparams.llama_folder, self.hparams.names)
        if self.hparams.together:
            adapters.train_adapters(model, self.hparams.names)
        if self.hparams.checkpointing:  # Hugging Face's own switch, as a user turns it on
            model.base_model.model.gradient_checkpointing_enable()
            model.train()  # transformers checkpoints only in train mode; from_pretrained gives eval mode
        return model

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()

    def _token_losses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")

    def _losses(self, batch: Any) -> dict[str, torch.Tensor]:
        if isinstance(batch, dict):  # multi-task: one batch per adapter, from a CombinedLoader
            return self._multitask_losses(batch)
        if not self.hparams.together:
            input_ids, attention_mask = batch
            mask = attention_mask[:, 1:].float()
            loss = (self._token_losses(input_ids, attention_mask) * mask).sum() / mask.sum()
            return {self.hparams.names[0]: loss}
        (input_ids, attention_mask), rows = adapters.sweep_batch(batch, self.hparams.names)
        with adapters.adapter_rows(self.model, rows):
            token_losses = self._token_losses(input_ids, attention_mask)
        return adapters.adapter_losses(token_losses, rows, attention_mask[:, 1:])

    def _multitask_losses(self, batches: dict[str, Any]) -> dict[str, torch.Tensor]:
        (input_ids, attention_mask), rows = adapters.multitask_batch(batches)
        with adapters.adapter_rows(self.model, rows):
            token_losses = self._token_losses(input_ids, attention_mask)
        return adapters.adapter_losses(token_losses, rows, attention_mask[:, 1:])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = self._losses(batch)
        self.log_dict({f"train_loss/{name}": loss for name, loss in losses.items()})
        return sum(losses.values())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log_dict({f"val_loss/{name}": loss for name, loss in self._losses(batch).items()})

    def configure_optimizers(self) -> Any:
        names = self.hparams.names
        keys = ("lr", "weight_decay", "betas")
        if self.hparams.together:
            groups = adapters.adapter_param_groups(self, {n: {k: SPECS[n][k] for k in keys} for n in names})
        else:
            groups = [
                {"params": [p for p in self.parameters() if p.requires_grad], **{k: SPECS[names[0]][k] for k in keys}}
            ]
        optimizer = torch.optim.AdamW(groups)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [_warmup(SPECS[n]["warmup"]) for n in names])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_batches(samples: int = 16, length: int = 12, batch_size: int = 4, seed: int = 3) -> DataLoader:
    """Random token ids for the tiny Llama, some rows padded at the end (mask 0), in a fixed order."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (samples, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (samples,), generator=generator)
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return DataLoader(TensorDataset(input_ids, attention_mask), batch_size=batch_size)


def adapter_weights(state_dict: dict[str, torch.Tensor], name: str) -> dict:
    """The entries of a checkpoint's ``state_dict`` that belong to adapter ``name`` (LoRA A/B of that name)."""
    return {key: value for key, value in state_dict.items() if f".{name}." in key and "lora_" in key}
