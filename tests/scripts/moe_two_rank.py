"""Fit ``tests.pretrained_support.MoELoRA`` (LoRA on attention and on the fused experts of a MoE folder) on N CPU
processes in fp32; ``--save-at`` saves a checkpoint mid-fit (ModelCheckpoint), ``--save`` one after it. Each rank
writes ``<report>/rank<R>.json``: each step's batch and loss, the bytes of the frozen experts' shards it holds
against the experts' whole, the ranges of the folder's tensors it read, and how often transformers' own ZeRO-3 loader
ran. ``--then`` starts the arguments of a next run in the same world (a Trainer of its own),
which saves starting the processes again."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import memory  # noqa: E402
from lightning_frozen.base import slice_reads  # noqa: E402
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

    reads: dict[str, list[list[int]]] = {}
    zero3_loads: list[int] = []
    with recorded(reads, zero3_loads):
        model = fit(args)
    experts = [p for name, p in model.named_parameters() if ".experts." in name and not p.requires_grad]
    held, device = memory.measured_frozen_shard_bytes(experts)
    report = {
        "rank": model.trainer.global_rank,
        "global_step": model.trainer.global_step,
        "losses": model.losses,
        "batches": [batch.tolist() for batch in model.batches],
        "experts_held_bytes": held,
        "experts_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in experts),
        "experts_device": device,
        "experts": len(experts),
        "reads": reads,
        "zero3_loads": len(zero3_loads),
    }
    write_report(Path(args.report), model.trainer.global_rank, report)
    torch.distributed.barrier()


@contextlib.contextmanager
def recorded(reads: dict[str, list[list[int]]], zero3_loads: list[int]) -> Iterator[None]:
    """While active, each slice the loader reads goes in ``reads`` (``[start, count]`` by folder key), and each call
    of transformers' own ZeRO-3 loader in ``zero3_loads``."""
    from transformers import modeling_utils

    read_ahead, zero3_loader = slice_reads.read_ahead, modeling_utils._load_state_dict_into_zero3_model

    def recording_reads(wanted: Any, *args: Any, **kwargs: Any) -> Any:
        for each in wanted:
            for part in [each] if isinstance(each, slice_reads.SliceRead) else each:
                reads.setdefault(part.key, []).append([part.start, part.count])
        return read_ahead(wanted, *args, **kwargs)

    @functools.wraps(zero3_loader)
    def recording_loads(*args: Any, **kwargs: Any) -> Any:
        zero3_loads.append(1)
        return zero3_loader(*args, **kwargs)

    slice_reads.read_ahead, modeling_utils._load_state_dict_into_zero3_model = recording_reads, recording_loads
    try:
        yield
    finally:
        slice_reads.read_ahead, modeling_utils._load_state_dict_into_zero3_model = read_ahead, zero3_loader


def fit(args: argparse.Namespace) -> MoELoRA:
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
    return model


if __name__ == "__main__":
    main()
