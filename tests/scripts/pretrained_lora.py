"""Fit ``tests.pretrained_support.PretrainedLoRA`` (``from_pretrained`` + PEFT in ``configure_model``) on N CPU
processes; each rank writes ``<report>/rank<R>.json`` with what it held at the start of training."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.distributed import write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import PretrainedLoRA, token_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    model = PretrainedLoRA(args.folder)
    trainer = cpu_trainer(devices=args.devices, max_steps=args.max_steps, max_epochs=-1, precision="bf16-mixed")
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    metrics = trainer.validate(model, token_data())
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "val_loss": metrics[0]["val_loss"],
        **model.seen_at_start,
    }
    write_report(Path(args.report), trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
