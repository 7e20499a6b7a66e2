"""The sweep on a causal LM: K LoRA adapters (q/v, as ``peer_qlora`` trains one) on a TinyLlama-1.1B-shaped folder.

The base is read with ``from_pretrained`` in ``configure_model``, as a user loads a hub checkpoint, and stored as
``frozen_dtype`` says (NF4 by default). Every adapter sees every row (``sweep_batch``); each row's loss is its
next-token cross-entropy, and each adapter's loss is the mean over its own rows and tokens.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_frozen import adapters as multi

TARGETS = ["q_proj", "v_proj"]


class CausalSweep(L.LightningModule):
    """A causal LM from ``folder`` with one LoRA adapter per entry of ``adapters`` (``{"rank", "alpha", "lr",
    "weight_decay"}``), trained at once on next-token prediction."""

    def __init__(self, folder: str, adapters: dict[str, dict[str, float]], checkpointing: bool = False) -> None:
        super().__init__()
        self.folder, self.specs, self.names = folder, adapters, list(adapters)
        self.checkpointing = checkpointing

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.folder)
        if self.checkpointing:
            base.gradient_checkpointing_enable()
        model: Any = None
        for name, spec in self.specs.items():
            lora = LoraConfig(r=int(spec["rank"]), lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=TARGETS)
            if model is None:
                model = get_peft_model(base, lora, adapter_name=name)
            else:
                model.add_adapter(name, lora)
        multi.train_adapters(model, self.names)
        model.train()  # from_pretrained returns eval mode
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,), rows = multi.sweep_batch(batch, self.names)
        with multi.adapter_rows(self.model, rows):
            logits = self.model(input_ids=input_ids).logits
        per_token = F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none"
        ).view(input_ids.shape[0], -1)
        return sum(multi.adapter_losses(per_token, rows).values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hyper = {name: {"lr": spec["lr"], "weight_decay": spec["weight_decay"]} for name, spec in self.specs.items()}
        return torch.optim.AdamW(multi.adapter_param_groups(self, hyper))


def token_batches(vocab_size: int, tokens: int, batches: int, batch_size: int) -> DataLoader:
    """``batches`` batches of ``batch_size`` random sequences of ``tokens`` ids, the same for every K."""
    ids = torch.randint(0, vocab_size, (batches * batch_size, tokens), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=batch_size)
