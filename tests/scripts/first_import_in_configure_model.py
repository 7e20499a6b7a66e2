"""A module whose configure_model is the first to import transformers' loader and PEFT (as benchmarks and many users'
scripts do: nothing of transformers imported at the top): write which modules of the loader were imported before the
fit, and whether the base was loaded into ZeRO-3 shards slice by slice (the package's log line).

    python first_import_in_configure_model.py FOLDER REPORT
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_frozen


class LoadsInConfigureModel(L.LightningModule):
    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model  # PEFT first: it imports transformers' loader itself
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.folder)
        self.model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    folder, report = sys.argv[1], Path(sys.argv[2])
    imported_before = sorted(m for m in ("transformers.modeling_utils", "peft.peft_model") if m in sys.modules)
    lines = Lines()
    for name in ("lightning_frozen", "lightning.pytorch"):  # the package logs through Lightning's rank-zero logger too
        logging.getLogger(name).addHandler(lines)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_frozen.FrozenAwareDeepSpeedStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randint(0, 100, (4, 8))), batch_size=2)
    trainer.fit(LoadsInConfigureModel(folder), data)
    sliced = any("into ZeRO-3 shards" in line for line in lines.lines)
    report.write_text(json.dumps(dict(imported_before=imported_before, sliced=sliced)))


if __name__ == "__main__":
    main()
