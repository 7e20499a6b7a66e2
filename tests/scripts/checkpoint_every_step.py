"""Train ``tests.models.AdapterModel`` in one process with ``ModelCheckpoint`` writing after every step.

The crash test SIGKILLs it at random moments and starts it again with ``--resume`` (the newest checkpoint). On
``on_train_start`` it writes ``<dir>/started.json`` with the global step training starts from. One batch per
epoch, so a checkpoint written after any step resumes exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH, RANK, SAMPLES = 128, 16, 8


class Progress(AdapterModel):
    """Logs its step, so ``ModelCheckpoint`` can keep the newest few step files by it."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("progress", float(self.global_step))
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        folder = Path(self.trainer.checkpoint_callback.dirpath)
        (folder / "started.json").write_text(json.dumps({"global_step": self.trainer.global_step}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--resume")
    args = parser.parse_args()

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    every_step = ModelCheckpoint(
        dirpath=args.dir, monitor="progress", mode="max", save_top_k=3, every_n_train_steps=1, save_last=True
    )
    trainer = cpu_trainer(max_steps=args.max_steps, max_epochs=-1, callbacks=[every_step], enable_checkpointing=True)
    model = Progress(width=WIDTH, rank=RANK)
    trainer.fit(model, regression_data(width=WIDTH, samples=SAMPLES, batch_size=SAMPLES), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
