"""BackboneFinetuning under ``frozen_deepspeed`` on 2 CPU processes: unfreeze the backbone at epoch 1 of 3. Each rank
also writes, as it exits, whether its gloo process group was destroyed before interpreter shutdown."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import BackboneModel, cpu_trainer, regression_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    # registered before the strategy's handler, so it runs after it (atexit runs last-in first-out)
    atexit.register(_write_group_state_at_exit, Path(args.report))
    module = BackboneModel(trainable_only=True)
    initial = module.backbone[0].weight.detach().clone()
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.005)
    trainer = cpu_trainer(devices=2, max_epochs=3, callbacks=[finetuning])
    trainer.fit(module, regression_data(width=16))
    with deepspeed.zero.GatheredParameters([module.backbone[0].weight]):
        changed = not torch.equal(module.backbone[0].weight.detach(), initial)
    report = {
        "groups": trainer.strategy.param_group_names,
        "backbone_changed": changed,
        "global_step": trainer.global_step,
    }
    write_report(Path(args.report), trainer.global_rank, report)


def _write_group_state_at_exit(out: Path) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    state = "alive" if torch.distributed.is_initialized() else "destroyed"
    (out / f"exit{rank if rank is not None else os.environ.get('LOCAL_RANK', 0)}.txt").write_text(state)


if __name__ == "__main__":
    main()
