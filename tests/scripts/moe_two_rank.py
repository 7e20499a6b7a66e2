"""Fit ``tests.pretrained_support.MoELoRA`` (LoRA on attention and on the fused experts of a MoE folder) on N CPU
processes in fp32; ``--save-at`` saves a checkpoint mid-fit (ModelCheckpoint), ``--save`` one after it. Each rank
writes ``<report>/rank<R>.json``: each step's batch and loss, and the bytes of the frozen experts' shards it holds
against the experts' whole. ``--then`` starts the arguments of a next run in the same world (a Trainer of its own),
which saves starting the processes again."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import memory  # noqa: E402
from tests.distributed import runs_of, write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import MoELoRA, token_data  # noqa: E402


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        run(arguments)


def run(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--save-at", type=int, help="also save <save-at>.ckpt beside --save after this step")
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report", required=True)
    args = parser.parse_args(arguments)

    model = MoELoRA(args.folder, lr=5e-2)
    callbacks = []
    if args.save_at:
        folder = Path(args.save).parent
        callbacks = [ModelCheckpoint(folder, f"step{args.save_at}", every_n_train_steps=args.save_at, save_top_k=-1)]
    trainer = cpu_trainer(
        devices=args.devices,
        max_steps=args.max_steps,
        max_epochs=-1,
        precision="32-true",
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    experts = [p for name, p in model.named_parameters() if ".experts." in name and not p.requires_grad]
    held, device = memory.measured_frozen_shard_bytes(experts)
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "losses": model.losses,
        "batches": [batch.tolist() for batch in model.batches],
        "experts_held_bytes": held,
        "experts_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in experts),
        "experts_device": device,
        "experts": len(experts),
    }
    write_report(Path(args.report), trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
