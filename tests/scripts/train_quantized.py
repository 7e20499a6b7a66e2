"""Train ``tests.models.AdapterModel`` with a quantized frozen base (``frozen_dtype``) on N CPU processes.

Lightning's launcher starts the other ranks by running this file again. For each ``--frozen-dtypes`` entry one
Trainer fits and saves ``<out>/<dtype>.ckpt``; then one more resumes the first of them for a second epoch
(``resumed``), and one runs both epochs without stopping (``straight``); each saves ``<out>/<run>.ckpt``. Each rank
writes ``<out>/<run>/rank<R>.json`` with its frozen shards' bytes, their codes' hash and the weight the first layer's
forward saw. One process pair for all runs: starting ranks costs more than these small fits; with
``--prefetch-out`` the pair also runs ``quantized_prefetch.py``'s three fits after these.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH = 128


def fit(
    frozen_dtype: str, devices: int, out: Path, run: str, max_epochs: int, resume: Optional[Path], watch: bool = True
) -> None:
    """One run; with ``watch``, the weight the first layer's forward saw first is reported, read by a pre-hook: the
    step it first reads the weight in is not bit-identical to an unwatched one, so the runs a resume is compared
    across are not watched."""
    model = AdapterModel(width=WIDTH)
    seen: dict[str, torch.Tensor] = {}

    def keep_first_weight(module: torch.nn.Module, inputs: tuple) -> None:
        seen.setdefault("weight", module.weight.detach().clone())

    if watch:
        model.layers[0].base.register_forward_pre_hook(keep_first_weight)
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype),
        devices=devices,
        max_epochs=max_epochs,
        precision="bf16-true",
    )
    trainer.fit(model, regression_data(width=WIDTH), ckpt_path=resume)
    trainer.save_checkpoint(out / f"{run}.ckpt")
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "frozen_numel": sum(int(p.ds_numel) for p in frozen.values()),
        "frozen_shard_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in frozen.values()),
        "frozen_shard_dtypes": sorted({str(p.ds_tensor.dtype) for p in frozen.values()}),
        "codes_sha256": {n: hashlib.sha256(p.ds_tensor.numpy().tobytes()).hexdigest() for n, p in frozen.items()},
        **({"seen_dtype": str(seen["weight"].dtype), "seen_weight": seen["weight"].float().tolist()} if watch else {}),
    }
    write_report(out / run, trainer.global_rank, report)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--frozen-dtypes", nargs="+", default=["nf4", "int8"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefetch-out", help="then quantized_prefetch.py's fits, in this world, into this folder")
    parser.add_argument("--small-shm", help="quantized_prefetch.py's --small-shm")
    args = parser.parse_args()
    out = Path(args.out)
    for frozen_dtype in args.frozen_dtypes:
        fit(frozen_dtype, args.devices, out, frozen_dtype, max_epochs=1, resume=None)
    first = args.frozen_dtypes[0]
    fit(first, args.devices, out, f"{first}-unwatched", max_epochs=1, resume=None, watch=False)
    fit(first, args.devices, out, "resumed", max_epochs=2, resume=out / f"{first}-unwatched.ckpt", watch=False)
    fit(first, args.devices, out, "straight", max_epochs=2, resume=None, watch=False)
    if args.prefetch_out:
        import quantized_prefetch  # beside this file, which is first on sys.path

        quantized_prefetch.fit_both(
            args.devices, Path(args.prefetch_out), Path(args.small_shm) if args.small_shm else None
        )


if __name__ == "__main__":
    main()
