"""PEFT's DeepSpeed guide's QLoRA code (``tests.pretrained_support.QLoRA``) fitted on N CPU processes under
``frozen_deepspeed`` (``--plain-nf4``: the same module without ``quantization_config``, with ``frozen_dtype="nf4"``).
Each rank writes ``<report>/rank<R>.json``: its frozen shards' codes, whether the weights in use are the folder's
quantized, the fingerprint, the losses and whether each LoRA B trained. ``--then`` starts the arguments of a next run
in the same world (a Trainer of its own), which saves starting the processes again."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import runs_of, write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import QLoRA, token_data  # noqa: E402


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        run(arguments)


def run(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--plain-nf4", action="store_true")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report", required=True)
    args = parser.parse_args(arguments)

    torch.manual_seed(0)
    model = QLoRA(args.folder, quantization=None if args.plain_nf4 else "nf4")
    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4" if args.plain_nf4 else None)
    trainer = cpu_trainer(strategy, devices=args.devices, max_steps=args.max_steps, max_epochs=-1, precision="32-true")
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    seen = dict(model.seen_at_start)
    trained = {}
    for name, param in model.named_parameters():
        if "lora_B" in name:
            with deepspeed.zero.GatheredParameters([param]):
                trained[name] = not torch.equal(param.detach().float(), seen["lora_b"][name])
    seen.pop("lora_b")
    report = {"global_step": trainer.global_step, "losses": model.losses, "lora_b_trained": trained, **seen}
    write_report(Path(args.report), trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
