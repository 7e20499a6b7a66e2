"""LoRA on a Llama-architecture causal LM loaded in ``configure_model``: the LightningModule and LightningDataModule.

The base is read with ``AutoModelForCausalLM.from_pretrained(folder)`` inside ``configure_model``, as a user loads a
hub checkpoint too large to build whole on every rank: under ``frozen_deepspeed`` each rank reads only its slice of
every tensor, straight into its ZeRO-3 shard. PEFT then adds LoRA to every linear layer of the decoder; the base
stays frozen and out of the optimizer.

The task is synthetic, so the example needs no download: sequences that count up by a fixed step modulo the
vocabulary (``7, 10, 13, 16, ...``). A random base cannot continue them; the adapter learns to.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

# The base is a local folder; never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_base(base_dir: str) -> torch.nn.Module:
    """The frozen base as a user loads it, in the dtype its folder was saved in."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir)


def counting_sequences(samples: int, length: int, step: int, vocab_size: int, seed: int) -> torch.Tensor:
    """``samples`` rows of ``length`` token ids, each ``step`` above the one before (mod ``vocab_size``)."""
    starts = torch.randint(0, vocab_size, (samples, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + step * torch.arange(length)) % vocab_size


class CausalLoRA(L.LightningModule):
    """A causal LM from ``base_dir`` with LoRA on every decoder projection, trained on next-token prediction.

    Args:
        base_dir: ``save_pretrained`` folder of the base model (``make_base.py`` writes one).
        rank: LoRA rank.
        alpha: LoRA scaling numerator (``lora_alpha``).
        lr: AdamW learning rate.
    """

    def __init__(self, base_dir: str, rank: int = 8, alpha: int = 16, lr: float = 5e-3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        # Lightning calls this hook again for validate/test/predict after fit: build the model once
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=self.hparams.rank,
            lora_alpha=self.hparams.alpha,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
        )
        self.model = get_peft_model(load_base(self.hparams.base_dir), lora)
        self.model.train()  # from_pretrained returns eval mode

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: Any) -> torch.Tensor:
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # All params, as a plain fine-tuning script would pass them: ZeRO-3 leaves the frozen ones out.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class CountingData(L.LightningDataModule):
    """Token sequences that count up by ``step`` modulo ``vocab_size``, from random starts.

    Args:
        vocab_size: the base's vocabulary size.
        step: the difference between neighbouring tokens.
        length: tokens per sequence.
        train_samples: training sequences.
        val_samples: validation sequences (other starts' order, drawn with another seed).
        batch_size: sequences per batch and rank.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        step: int = 3,
        length: int = 16,
        train_samples: int = 512,
        val_samples: int = 64,
        batch_size: int = 16,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def sequences(self, split: str) -> torch.Tensor:
        """The ``train`` or ``val`` sequences."""
        h = self.hparams
        samples, seed = (h.train_samples, 0) if split == "train" else (h.val_samples, 1)
        return counting_sequences(samples, h.length, h.step, h.vocab_size, seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.sequences("train")), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.sequences("val")), batch_size=self.hparams.batch_size)
