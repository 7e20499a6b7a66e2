"""Train ``tests.models.AdapterModel`` under ``frozen_deepspeed`` on N CPU processes; the tests run it as a script.

Lightning's launcher starts the other ranks by running this file again. Each rank writes
``<report>/rank<R>.json`` with what it holds; ``--save`` writes a checkpoint after fit. ``--then`` starts the
arguments of a next run in the same world (a Trainer of its own), which saves starting the processes again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import runs_of, write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        run(arguments)


def run(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--validate", help="run trainer.validate(ckpt_path=...) instead of fit")
    parser.add_argument("--report", required=True)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args(arguments)

    model = AdapterModel(width=args.width, rank=args.rank)
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(),
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.max_epochs,
        precision=args.precision,
    )
    if args.validate:
        metrics = trainer.validate(model, regression_data(width=args.width), ckpt_path=args.validate)
    else:
        metrics = None
        trainer.fit(model, regression_data(width=args.width), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    engine_optimizer = trainer.strategy.deepspeed_engine.optimizer
    flats = getattr(engine_optimizer, "fp32_partitioned_groups_flat", [])
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "fp32_partition_numel": sum(int(flat.numel()) for flat in flats),
        "metrics": metrics,
        "params": {
            name: {
                "trainable": param.requires_grad,
                "numel": int(param.ds_numel),
                "shard_numel": int(param.ds_tensor.numel()),
                "shard_device": param.ds_tensor.device.type,
                "shard_dtype": str(param.ds_tensor.dtype),
                "grad_is_none": param.grad is None,
            }
            for name, param in model.named_parameters()
        },
    }
    write_report(Path(args.report), trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
