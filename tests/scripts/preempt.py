"""Train ``tests.models.AdapterModel`` under ``frozen_deepspeed`` on 2 CPU processes and send SIGTERM to some ranks at
one exact point of one step; the preemption tests run it as a script, resuming each run from ``last.ckpt``.

Points (``--at``), on the ranks of ``--ranks``, when ``global_step`` is ``--step``: ``forward`` (the start of the
training step, before the ZeRO-3 all-gathers of the forward), ``backward`` (a gradient hook on the head's input, with
the layers' backward still to come), ``optimizer_step`` (inside the ZeRO optimizer's step, as its inner torch
optimizer steps) and ``save`` (rank 0, in the middle of writing the periodic checkpoint's temp file), and ``validation``
(the first of the two validation batches each rank runs after every step). ``--second``
sends rank 0 a second SIGTERM in the middle of writing the stop checkpoint; ``--stuck`` keeps rank 1 from ever
reaching the step boundary. One batch per rank per epoch, so a checkpoint after any step resumes exactly. Each rank
writes ``<report>/rank<R>.json`` with its exit status and global step; a finished fit saves ``<dir>/final.ckpt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.checkpoint import file  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


class Signalling(AdapterModel):
    args: argparse.Namespace  # set after construction, so that it stays out of the hyper-parameters

    def _now(self, at: str) -> bool:
        return self.args.at == at and self.global_step == self.args.step and self.global_rank in self.args.ranks

    def _signal(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        if self.args.stuck and self.global_rank == 1:
            time.sleep(600)  # a rank that cannot reach the step boundary in time

    validation_batches = 0  # run after the step ``--step``

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_batches += self.global_step == self.args.step
        if batch_idx == 0 and self._now("validation"):
            self._signal()
        super().validation_step(batch, batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self._now("forward"):
            self._signal()
        return super().training_step(batch, batch_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self._now("backward") and x.requires_grad:
            x.register_hook(lambda grad: self._signal())
        return self.head(x)

    def on_train_start(self) -> None:
        inner = self.trainer.strategy.deepspeed_engine.optimizer.optimizer  # the torch AdamW ZeRO-3 steps
        inner.register_step_pre_hook(lambda *_: self._signal() if self._now("optimizer_step") else None)
        write_file = file.write_file_atomic

        def write_file_signalling(path: Path, write: Any) -> None:
            def write_then_signal(handle: Any) -> None:
                write(handle)
                handle.flush()
                periodic = path.name != "last.ckpt" and self._now("save")
                if periodic or (path.name == "last.ckpt" and self.args.second):
                    os.kill(os.getpid(), signal.SIGTERM)

            write_file(path, write_then_signal)

        file.write_file_atomic = write_file_signalling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="fit(ckpt_path='last')")
    parser.add_argument(
        "--at", choices=["none", "forward", "backward", "optimizer_step", "save", "validation"], default="none"
    )
    parser.add_argument("--step", type=int, default=-1)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[0, 1])
    parser.add_argument("--second", action="store_true")
    parser.add_argument("--stuck", action="store_true")
    parser.add_argument("--grace", type=float, default=60.0)
    args = parser.parse_args()
    # SIGTERM's default action before the strategy's handler, whatever the suite was started under (one that ignores it)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    periodic = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=1, save_top_k=1)
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(preemption_grace=args.grace),
        devices=2,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[periodic],
        enable_checkpointing=True,
    )
    model = Signalling()
    model.args = args
    data = regression_data(samples=16, batch_size=8)  # one batch per rank per epoch
    validation = regression_data(samples=32, batch_size=8, seed=2)  # two batches per rank, after every step
    status = 0
    try:
        trainer.fit(model, data, validation, ckpt_path="last" if args.resume else None)
    except SystemExit as stop:
        status = stop.code
        raise
    finally:
        write_report(
            Path(args.report),
            trainer.global_rank,
            {"status": status, "global_step": trainer.global_step, "validation_batches": model.validation_batches},
        )
    trainer.save_checkpoint(Path(args.dir) / "final.ckpt")


if __name__ == "__main__":
    main()
