"""Save a LoRA-shaped model trained on N CPU ranks, then write beside it what DeepSpeed's own world-size independent
accessors gather (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``: what a save wrote before saves were
gathered one param at a time to rank 0), for the test to compare tensor by tensor.

``--fail-write`` makes rank 0's write fail (no space left) once the first tensor is in: every rank must come back
from ``save_checkpoint`` (rank 0 with the error), the previous file whole.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.zero import torch_file  # noqa: E402
from lightning_frozen.zero.params import full_param, optimizer_state_of  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


def adapters_only(module: AdapterModel) -> torch.optim.Optimizer:
    # the head trains without an optimizer group: it is saved from the param itself, not from an fp32 master copy
    adapters = [p for name, p in module.named_parameters() if "lora" in name]
    return torch.optim.AdamW(adapters, lr=module.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--fail-write", action="store_true")
    args = parser.parse_args()

    # width 7, rank 3: each adapter (21 elements), the head's weight (7) and bias (1) split unevenly over 2 ranks
    model = AdapterModel(width=7, rank=3, optimizer_fn=adapters_only)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), devices=args.devices, max_epochs=1, precision=args.precision)
    trainer.fit(model, regression_data(width=7))
    path = args.out / "streamed.ckpt"
    trainer.save_checkpoint(path)
    report: dict = {"rank": trainer.global_rank}
    if args.fail_write:
        before = path.read_bytes()
        pwrite, calls = os.pwrite, []

        def full_disk(fd: int, data: bytes, offset: int) -> int:
            calls.append(offset)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return pwrite(fd, data, offset)

        torch_file.os.pwrite = full_disk if trainer.global_rank == 0 else pwrite
        try:
            trainer.save_checkpoint(path)
        except OSError as error:
            report["error"] = str(error)
            trainer.strategy.barrier()  # the one `Trainer.save_checkpoint` ends with, which the raise skipped
        finally:
            torch_file.os.pwrite = pwrite
        report["previous_file_whole"] = path.read_bytes() == before
        report["left_in_folder"] = sorted(p.name for p in args.out.iterdir())
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    reference = {
        name: full_param(param, None if name.startswith("head") else optimizer)
        for name, param in model.named_parameters()
        if param.requires_grad
    }
    states = {
        name: optimizer_state_of(optimizer, param)
        for name, param in model.named_parameters()
        if param.requires_grad and not name.startswith("head")
    }
    if trainer.global_rank == 0:
        torch.save({"state_dict": reference, "state": states}, args.out / "reference.pt")
    write_report(args.out / "reports", trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
