"""A user's first 2-rank LoRA fit: the README's main job (MiniLM + LoRA) with a plain Trainer, as the Quickstart
writes it (imports first, no logging set up, Lightning's default logger and checkpointing), without the progress bar,
whose redraws are no lines. The test counts what it prints; Lightning's launcher starts rank 1 by running this file
again."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

import lightning_frozen  # noqa: E402, F401  (registers "frozen_deepspeed")
from examples.minilm_lora.task import LoRASentimentClassifier, SentimentData  # noqa: E402

if __name__ == "__main__":
    trainer = L.Trainer(
        strategy="frozen_deepspeed",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        enable_progress_bar=False,
        default_root_dir=sys.argv[1],
    )
    trainer.fit(LoRASentimentClassifier(), SentimentData())
