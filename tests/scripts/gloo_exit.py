"""Fit and save on CPU ranks, then leave gloo busy as the process exits: many async ``all_reduce`` and ``all_gather``
calls whose tensors' last Python references die at once, so that gloo's workers free them while the interpreter
shuts down. Left to finalization, a worker that frees them takes the GIL and the rank aborts with "terminate called
without an active exception".

Run it once per simulated node (``--devices=1 --num-nodes=2`` with ``NODE_RANK``, as
``tests.distributed.launch`` does), so that each rank's exit status is its own. Each rank writes
``<dir>/rank<R>.json`` once it has issued the collectives. ``--exit-hook=destroy-only`` puts back the exit hook as
it was before it waited for gloo's workers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import destroy_only_at_exit, write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


def leave_collectives_in_flight(count: int) -> None:
    """``count`` async all_reduce and all_gather calls on the default group, their handles and tensors dropped."""
    for _ in range(count):
        dist.all_reduce(torch.randn(20_000), async_op=True)
        dist.all_gather([torch.empty(2_000) for _ in range(dist.get_world_size())], torch.randn(2_000), async_op=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--collectives", type=int, default=200)
    parser.add_argument("--exit-hook", choices=["package", "destroy-only"], default="package")
    args = parser.parse_args()
    if args.exit_hook == "destroy-only":
        destroy_only_at_exit()

    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), devices=args.devices, num_nodes=args.num_nodes)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(Path(args.dir) / "fit.ckpt")
    leave_collectives_in_flight(args.collectives)
    write_report(Path(args.dir), trainer.global_rank, {"rank": trainer.global_rank, "step": trainer.global_step})


if __name__ == "__main__":
    main()
